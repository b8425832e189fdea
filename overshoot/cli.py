"""The `overshoot` command line: report, export and run.

Starts fast: pandas/pyarrow are imported inside the commands that need them, torch never, and `run` (owned by
overshoot/run/command.py) is imported only when that command is invoked. Bad input ends with one line on
stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperGroup

try:  # typer >= 0.20 vendors click as typer._click; older typer uses click itself
    from typer._click import exceptions as _click_errors
except ImportError:  # pragma: no cover
    from click import exceptions as _click_errors

RUN_HELP = "Launch a server with hooks, drive load, record every step and print the report."


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 1."""


class _LazyGroup(TyperGroup):
    """Adds `run` from overshoot.run.command only when it is invoked; help lists it without importing it."""

    _listing_help = False

    def list_commands(self, ctx) -> list[str]:
        names = list(super().list_commands(ctx))
        if "run" not in names and _run_available():
            names.insert(0, "run")
        return names

    def get_command(self, ctx, name: str):
        if name == "run" and "run" not in self.commands and _run_available():
            if self._listing_help:  # the command list of --help needs only the one-line help
                return _run_listing()
            self.commands["run"] = _load_run_command()
        return super().get_command(ctx, name)

    def format_help(self, ctx, formatter) -> None:
        self._listing_help = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing_help = False


def _run_available() -> bool:
    return importlib.util.find_spec("overshoot.run.command") is not None


def _run_listing():
    listing = typer.Typer(add_completion=False)
    listing.command("run", help=RUN_HELP)(lambda: None)
    return typer.main.get_command(listing)


def _load_run_command():
    from overshoot.run import command as run_cmd

    single = typer.Typer(add_completion=False, rich_markup_mode="rich")
    single.command("run", help=(run_cmd.run.__doc__ or RUN_HELP))(run_cmd.run)
    return typer.main.get_command(single)


app = typer.Typer(
    name="overshoot",
    cls=_LazyGroup,
    help="Is my LLM server's decode step CPU-bound or GPU-bound, step by step, and will a GPU change pay "
    "off?",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)


def _load(path: Path):
    from overshoot.rundir.meta import RunDirError
    from overshoot.rundir.reader import load_run

    try:
        run = load_run(path)
    except RunDirError as e:
        raise CliError(str(e)) from None
    for warning in run.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return run


@app.command(
    epilog=(
        "[b]Examples[/b]\n\n"
        "  overshoot report runs/demo\n\n"
        "  overshoot report runs/demo --what-if gpu=-10% --what-if cpu=-20% --warmup 20\n\n"
        "  overshoot report runs/before --compare runs/after\n\n"
        "  overshoot report runs/demo --json > summary.json"
    )
)
def report(
    run: Annotated[Path, typer.Argument(help="Run directory (written by `overshoot run` or a Recorder).")],
    what_if: Annotated[
        list[str] | None,
        typer.Option(
            "--what-if",
            help="Projection to show, e.g. gpu=-10% or cpu=-10% (repeatable; default both at -10%).",
        ),
    ] = None,
    cpu_bound_share: Annotated[
        str, typer.Option(help="A step is CPU-bound when the GPU idled, waiting for the CPU, for more than "
                          "this share of it (e.g. 5%).")
    ] = "5%",
    cpu_bound_ms: Annotated[
        float, typer.Option(help="thread_never_waited: the thread waited at most this many ms in the step.",
                            min=0.0)
    ] = 0.02,
    warmup: Annotated[int, typer.Option(help="Skip the first N steps of each timeline/level.", min=0)] = 0,
    compare: Annotated[
        Path | None, typer.Option(help="Second run: show A vs B side by side with deltas.")
    ] = None,
    mode: Annotated[
        str | None, typer.Option(help="Scheduling: sync or async (default: detected from the data).")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead.")] = False,
) -> None:
    """Per (concurrency, phase, batch size): step times, CPU-bound and GPU idle shares, what-ifs."""
    from overshoot.analysis.whatif import parse_what_if

    if mode not in (None, "sync", "async"):
        raise CliError(f"bad --mode {mode!r}: choose sync or async")
    try:
        what_ifs = [parse_what_if(text) for text in what_if or []]
    except ValueError as e:
        raise CliError(str(e)) from None
    import json

    from rich.console import Console

    from overshoot.report import compare as cmp
    from overshoot.report import table as rep

    options = {"what_ifs": what_ifs, "cpu_bound_ms": cpu_bound_ms, "cpu_bound_share": _share(cpu_bound_share),
               "warmup_steps": warmup, "mode": mode}
    first = rep.build_report(_load(run), **options)
    console = Console()
    if compare is None:
        if json_output:
            print(json.dumps(first, indent=2))
        else:
            rep.render(first, console)
        return
    second = rep.build_report(_load(compare), **options)
    rows = cmp.compare(first, second)
    if json_output:
        both = {"a": first, "b": second, "compare": rows, "compare_client": cmp.compare_client(first, second)}
        print(json.dumps(both, indent=2))
    else:
        cmp.render_compare(first, second, rows, console)


@app.command(
    epilog=(
        "[b]Examples[/b]\n\n"
        "  overshoot export runs/demo -o steps.parquet\n\n"
        "  overshoot export runs/demo -o spans.csv --what spans\n\n"
        "  overshoot export runs/demo -o trace.json --format chrome   (open in ui.perfetto.dev)"
    )
)
def export(
    run: Annotated[Path, typer.Argument(help="Run directory.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="File to write.")],
    what: Annotated[
        str, typer.Option(help="Table: steps, spans, gpu or kernels (chrome always holds all of them).")
    ] = "steps",
    format: Annotated[
        str | None,
        typer.Option(
            "--format", help="parquet, csv or chrome (default: from the file suffix, else parquet)."
        ),
    ] = None,
    cpu_bound_share: Annotated[
        str, typer.Option(help="CPU-bound: the GPU idled more than this share of the step (e.g. 5%).")
    ] = "5%",
    cpu_bound_ms: Annotated[
        float, typer.Option(help="thread_never_waited threshold for the steps table.", min=0.0)
    ] = 0.02,
    warmup: Annotated[int, typer.Option(help="Skip the first N steps of each timeline/level.", min=0)] = 0,
) -> None:
    """Write the steps, spans or GPU table as Parquet/CSV, or the run as a Chrome/Perfetto trace."""
    from overshoot.export import FORMATS, WHATS, ExportError
    from overshoot.export import export as write_export

    if what not in WHATS:
        raise CliError(f"unknown --what {what!r}: choose one of {', '.join(WHATS)}")
    if format is not None and format not in FORMATS:
        raise CliError(f"unknown --format {format!r}: choose one of {', '.join(FORMATS)}")
    loaded = _load(run)
    try:
        fmt, count = write_export(
            loaded, output, what=what, fmt=format, cpu_bound_ms=cpu_bound_ms,
            cpu_bound_share=_share(cpu_bound_share), warmup_steps=warmup,
        )
    except ExportError as e:
        raise CliError(str(e)) from None
    unit = "events" if fmt == "chrome" else "rows"
    print(f"wrote {output} ({fmt}, {count} {unit})", file=sys.stderr)


def _share(text: str) -> float:
    """'5%' or '5' -> 0.05 (a share is always in percent; a bare number is read as percent too)."""
    try:
        value = float(text.strip().rstrip("%"))
    except ValueError:
        raise CliError(f"bad --cpu-bound-share {text!r}: expected a percentage such as 5%") from None
    if not 0 <= value < 100:
        raise CliError(f"bad --cpu-bound-share {text!r}: must be from 0% to below 100%")
    return value / 100


def main(argv: list[str] | None = None) -> int:
    """Console entry point: every user error becomes one line on stderr instead of a traceback or a box."""
    args = sys.argv[1:] if argv is None else argv
    command = typer.main.get_command(app)
    try:
        result = command.main(args=args, prog_name="overshoot", standalone_mode=False)
    except getattr(_click_errors, "NoArgsIsHelpError", ()):
        return main(["--help"])
    except _click_errors.ClickException as e:
        ctx = getattr(e, "ctx", None)
        where = f"overshoot {ctx.info_name}" if ctx is not None and ctx.parent is not None else "overshoot"
        print(f"{where}: error: {e.format_message()}", file=sys.stderr)
        return e.exit_code
    except CliError as e:
        sub = next((a for a in args if not a.startswith("-")), "")
        print(f"overshoot {sub}: error: {e}" if sub else f"overshoot: error: {e}", file=sys.stderr)
        return 1
    except (typer.Abort, KeyboardInterrupt):
        print("overshoot: aborted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
