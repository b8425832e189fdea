"""Formatting shared by the report, compare and check: numbers ("-" for a missing value, never "-0.0") and
the compact table style."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table

# Piped output (not a terminal) is as wide as the widest table: no column dropped or cut at 80 columns.
PIPE_WIDTH = 10_000


def output_console(width: int | None = None) -> Console:
    """The console of a command's output: `width` columns if given, else the terminal's, else unlimited."""
    if width is not None:
        return Console(width=width)
    console = Console()
    return console if console.is_terminal else Console(width=PIPE_WIDTH)


def fmt_num(value, fmt: str = ".2f") -> str:
    """A number as `fmt` says, "-" for none; a value that rounds to zero prints unsigned ("0.0", never
    "-0.0")."""
    if value is None:
        return "-"
    text = format(value, fmt)
    if text.lstrip("+-").strip("0.,") == "":  # zero, maybe signed: print it unsigned
        return format(type(value)(0), fmt.lstrip("+"))
    return text


def signed(value, fmt: str = ".1f", unit: str = "") -> str:
    """A change with its sign ("+1.2%", "-0.4 pts", "0.0%"); "-" for none."""
    return "-" if value is None else fmt_num(value, "+" + fmt) + unit


def pct(value, digits: int = 0) -> str:
    return "n/a" if value is None else fmt_num(value, f".{digits}f") + "%"


def report_table(title: str) -> Table:
    # Compact: fits 80 columns for the common case (no level column, two what-ifs).
    return Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 0),
        pad_edge=False,
        show_edge=False,
    )


def estimate_range(row: dict, key: str, *, brief: bool = False) -> str:
    """' (a-b% as the GPU busy estimate moves within its 95% interval)' for a group whose plain steps take
    their GPU busy from instrumented ones (`key`_low/_high); '' where there is no such range, or where both
    ends round to the same percent."""
    low, high = row.get(f"{key}_low"), row.get(f"{key}_high")
    if low is None or high is None or round(low) == round(high):  # (no range, or none worth a word)
        return ""
    span = f"{low:.0f}-{high:.0f}%"
    return f" [{span}]" if brief else f" ({span} as the GPU busy estimate moves within its 95% interval)"
