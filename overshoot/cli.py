"""The `overshoot` command line: report, check, plot, export and run.

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
    """A user-facing error: printed as one line, exit code `code` (1 unless a command documents another)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


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


def _version(value: bool) -> None:
    if value:
        from overshoot import __version__

        print(f"overshoot {__version__}")
        raise typer.Exit()


@app.callback()
def _top(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    pass


def _load(path: Path, *, code: int = 1):
    from overshoot.rundir.meta import RunDirError
    from overshoot.rundir.reader import load_run

    try:
        run = load_run(path)
    except RunDirError as e:
        raise CliError(str(e), code) from None
    for warning in run.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return run


def _console(width: int | None = None):
    from overshoot.report.fmt import output_console

    return output_console(width)


def _what_ifs(texts: list[str] | None) -> list:
    """--what-if values; the sign is required (gpu=10 could mean either way)."""
    from overshoot.analysis.whatif import parse_what_if

    out = []
    for text in texts or []:
        try:
            out.append(parse_what_if(text))
        except ValueError as e:
            raise CliError(str(e)) from None
        if text.partition("=")[2].strip()[:1] not in ("+", "-"):
            raise CliError(
                f"bad --what-if {text!r}: give the sign, e.g. gpu=-10% (faster) or gpu=+10% (slower)"
            )
    return out


_ANALYSIS_HELP = {
    "cpu_bound_share": "A step is CPU-bound when the GPU idled, waiting for the CPU, for more than this "
                       "share of it (e.g. 5%).",
    "cpu_bound_ms": "thread_never_waited: the thread waited at most this many ms in the step.",
    "warmup": "Skip the first N steps of each timeline/level.",
}


@app.command(
    epilog=(
        "[b]Examples[/b]\n\n"
        "  overshoot report runs/demo\n\n"
        "  overshoot report runs/demo --what-if gpu=-10% --what-if cpu=-20% --warmup 20 --by-label\n\n"
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
    cpu_bound_share: Annotated[str, typer.Option(help=_ANALYSIS_HELP["cpu_bound_share"])] = "5%",
    cpu_bound_ms: Annotated[float, typer.Option(help=_ANALYSIS_HELP["cpu_bound_ms"], min=0.0)] = 0.02,
    warmup: Annotated[int, typer.Option(help=_ANALYSIS_HELP["warmup"], min=0)] = 0,
    compare: Annotated[
        Path | None, typer.Option(help="Second run: show A vs B side by side with deltas.")
    ] = None,
    mode: Annotated[
        str | None, typer.Option(help="Scheduling: sync or async (default: detected from the data).")
    ] = None,
    by_label: Annotated[
        bool, typer.Option("--by-label", help="Also show CPU busy time by label per group.")
    ] = False,
    width: Annotated[
        int | None,
        typer.Option(
            help="Output width in columns.", min=40, show_default="the terminal's; unlimited when piped"
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead.")] = False,
) -> None:
    """Per (concurrency, phase, batch size): step times, CPU-bound and GPU idle shares, what-ifs."""
    if mode not in (None, "sync", "async"):
        raise CliError(f"bad --mode {mode!r}: choose sync or async")
    what_ifs = _what_ifs(what_if)
    import json

    from overshoot.analysis import noise
    from overshoot.report import compare as cmp
    from overshoot.report import table as rep

    options = {"what_ifs": what_ifs, "cpu_bound_ms": cpu_bound_ms,
               "cpu_bound_share": _share(cpu_bound_share), "warmup_steps": warmup, "mode": mode}
    first, summary_a = rep.analyse(_load(run), **options)
    console = _console(width)
    if compare is None:
        if json_output:
            print(json.dumps(first, indent=2))
        else:
            rep.render(first, console, by_label=by_label)
        return
    second, summary_b = rep.analyse(_load(compare), **options)
    rows = cmp.compare(
        first, second, samples_a=noise.summary_samples(summary_a), samples_b=noise.summary_samples(summary_b)
    )
    if json_output:
        both = {
            "a": first, "b": second, "compare": rows, "compare_client": cmp.compare_client(first, second),
            "noise_method": noise.METHOD,
        }  # fmt: skip
        print(json.dumps(both, indent=2))
    else:
        cmp.render_compare(first, second, rows, console, by_label=by_label)


@app.command(
    epilog=(
        "[b]Examples[/b]\n\n"
        "  overshoot check runs/nightly --max-cpu-bound 10%\n\n"
        "  overshoot check runs/pr --baseline runs/main --max-regression 3% --max-gpu-idle 20%\n\n"
        "Exit status: 0 when every limit holds, 1 with one line per broken limit, 2 on bad input."
    )
)
def check(
    run: Annotated[Path, typer.Argument(help="Run directory to check.")],
    baseline: Annotated[
        Path | None, typer.Option(help="Run to compare with (needed by --max-regression).")
    ] = None,
    max_cpu_bound: Annotated[
        str | None, typer.Option(help="Most CPU-bound steps allowed in any group, e.g. 10%.")
    ] = None,
    max_gpu_idle: Annotated[
        str | None, typer.Option(help="Most GPU idle share allowed in any group, e.g. 20%.")
    ] = None,
    max_regression: Annotated[
        str | None,
        typer.Option(help="Most a group's median step may grow over the baseline's, e.g. 3%."),
    ] = None,
    min_steps: Annotated[
        int, typer.Option(help="Groups with fewer steps are not checked.", min=1)
    ] = 20,
    cpu_bound_ms: Annotated[float, typer.Option(help=_ANALYSIS_HELP["cpu_bound_ms"], min=0.0)] = 0.02,
    warmup: Annotated[int, typer.Option(help=_ANALYSIS_HELP["warmup"], min=0)] = 0,
) -> int:
    """Exit 0 when the run keeps the given limits, 1 with one line per broken limit (for CI pipelines)."""
    from overshoot.report import check as gate

    try:
        limits = gate.Limits(
            max_cpu_bound_pct=gate.parse_pct(max_cpu_bound, "--max-cpu-bound"),
            max_gpu_idle_pct=gate.parse_pct(max_gpu_idle, "--max-gpu-idle"),
            max_regression_pct=gate.parse_pct(max_regression, "--max-regression"),
            min_steps=min_steps,
        )
    except ValueError as e:
        raise CliError(str(e), 2) from None
    if not limits.any():
        raise CliError("no limit given: pass --max-cpu-bound, --max-gpu-idle or --max-regression", 2)
    if limits.max_regression_pct is not None and baseline is None:
        raise CliError("--max-regression needs --baseline RUN", 2)
    from overshoot.analysis import noise
    from overshoot.report import compare as cmp
    from overshoot.report import table as rep

    options = {"cpu_bound_ms": cpu_bound_ms, "warmup_steps": warmup, "projections": False}
    report, summary = rep.analyse(_load(run, code=2), **options)
    if report.get("status_line"):
        print(f"warning: {report['status_line']}", file=sys.stderr)
    compared = None
    if baseline is not None:
        base, base_summary = rep.analyse(_load(baseline, code=2), **options)
        compared = cmp.compare(
            base, report, samples_a=noise.summary_samples(base_summary),
            samples_b=noise.summary_samples(summary),
        )  # fmt: skip
    for option, limit, key in (("--max-gpu-idle", limits.max_gpu_idle_pct, "gpu_idle_pct"),
                               ("--max-cpu-bound", limits.max_cpu_bound_pct, "cpu_bound_pct")):
        if limit is not None and all(g[key] is None for g in report["groups"]):
            raise CliError(f"{option}: {run} has no GPU times to check", 2)
    outcome = gate.check(report, limits, compared=compared)
    if outcome.checked == 0:
        raise CliError(f"no group of {run} has {min_steps} steps or more (--min-steps)", 2)
    for line in outcome.broken:
        print(line)
    if outcome.broken:
        return 1
    print(outcome.summary)
    return 0


@app.command(
    epilog=(
        "[b]Examples[/b]\n\n"
        "  overshoot plot runs/demo -o plots/\n\n"
        "  overshoot plot runs/before --compare runs/after -o plots/"
    )
)
def plot(
    run: Annotated[Path, typer.Argument(help="Run directory.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Directory to write the PNG files to.")],
    compare: Annotated[
        Path | None, typer.Option(help="Second run: one panel per run in each figure.")
    ] = None,
    cpu_bound_ms: Annotated[float, typer.Option(help=_ANALYSIS_HELP["cpu_bound_ms"], min=0.0)] = 0.02,
    warmup: Annotated[int, typer.Option(help=_ANALYSIS_HELP["warmup"], min=0)] = 0,
) -> None:
    """Write timeline.png, cpu_vs_gpu.png and groups.png (matplotlib: pip install 'overshoot\\[plot]')."""
    if importlib.util.find_spec("matplotlib") is None:
        raise CliError("plotting needs matplotlib, which is not installed: pip install 'overshoot[plot]'")
    from overshoot.report import plot as pictures
    from overshoot.report import table as rep

    runs = []
    options = {"cpu_bound_ms": cpu_bound_ms, "warmup_steps": warmup, "projections": False}
    for name, path in (("A", run), ("B", compare)) if compare is not None else (("", run),):
        loaded = _load(path)
        report, summary = rep.analyse(loaded, **options)
        title = f"{name} = {report['run_id']}" if name else report["run_id"]
        runs.append(pictures.PlotRun(title, report, summary.steps, (loaded.meta or {}).get("levels") or []))
    try:
        written = pictures.plot_runs(runs, output)
    except OSError as e:
        raise CliError(f"cannot write to {output}: {e.strerror or e}") from None
    for w in written:
        print(f"wrote {w.path} ({', '.join(p['title'] for p in w.panels)})", file=sys.stderr)


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
    output: Annotated[Path | None, typer.Option("--output", "-o", help="File to write.")] = None,
    what: Annotated[
        str, typer.Option(help="Table: steps, spans, gpu, kernels, ranks or idle (GPU idle by host work; "
                               "chrome always holds steps, spans, gpu and kernels).")
    ] = "steps",
    dataset: Annotated[Path | None, typer.Option(
        "--dataset", help="Instead of one file: every table as a hive-partitioned Parquet dataset under this "
                          "folder, by run and rank (several runs can share it).")] = None,
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
    warmup: Annotated[int, typer.Option(help=_ANALYSIS_HELP["warmup"], min=0)] = 0,
) -> None:
    """Write the steps, spans, GPU, kernels or per-rank table as Parquet/CSV, the run as a Chrome/Perfetto
    trace, or every table as a Parquet dataset (--dataset)."""
    from overshoot.export import FORMATS, WHATS, ExportError
    from overshoot.export import export as write_export

    if (output is None) == (dataset is None):
        raise CliError("give either --output FILE or --dataset DIR")
    if dataset is not None:
        _export_dataset(_load(run), dataset, cpu_bound_ms=cpu_bound_ms,
                        cpu_bound_share=_share(cpu_bound_share), warmup=warmup)
        return
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
    print(f"wrote {output} ({fmt}, {count} {unit}){_why_empty(loaded, what) if not count else ''}",
          file=sys.stderr)


def _why_empty(loaded, what: str) -> str:
    """Why an exported table has no rows, where the run says (an empty file is easy to take for a bug)."""
    if what == "kernels":
        mode = (loaded.meta.get("options") or {}).get("gpu_timing")
        how = f"recorded with --gpu-timing {mode}" if mode else "no kernel timing"
        return f"; no kernel records in this run ({how}; kernels and sampled record them, on a CUDA GPU)"
    if what == "gpu":
        return "; no GPU intervals in this run (no CUDA device, or --gpu-timing off)"
    if what == "idle":
        return "; no step with its GPU idle known from kernel records (--gpu-timing sampled or kernels)"
    return f"; the run has no {what} in its analysed steps"


def _export_dataset(loaded, out: Path, *, cpu_bound_ms: float, cpu_bound_share: float, warmup: int) -> None:
    from overshoot.analysis.analyze import summarize
    from overshoot.dataset import DatasetError, export_dataset
    from overshoot.export import idle_table, table_of

    tables = {what: table_of(loaded, what, cpu_bound_ms=cpu_bound_ms, cpu_bound_share=cpu_bound_share,
                             warmup_steps=warmup) for what in ("steps", "spans", "gpu", "kernels")}
    summary = summarize(loaded, cpu_bound_ms=cpu_bound_ms, cpu_bound_share=cpu_bound_share,
                        warmup_steps=warmup)  # one analysis for the idle table and the ranks
    tables["idle"] = idle_table(loaded, summary)
    ranks = summary.ranks
    try:
        written = export_dataset(loaded, out, tables=tables,
                                 rank_rows=None if ranks is None else ranks.per_rank)
    except DatasetError as e:
        raise CliError(str(e)) from None
    counts = ", ".join(f"{name} {n}" for name, n in written.items())
    print(f"wrote {out} (hive-partitioned parquet by run and rank; rows: {counts})", file=sys.stderr)


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
    except _click_errors.NoSuchOption as e:
        print(f"{_where(e)}: error: {_no_such_option(e)}", file=sys.stderr)
        return e.exit_code
    except _click_errors.ClickException as e:
        print(f"{_where(e)}: error: {e.format_message()}", file=sys.stderr)
        return e.exit_code
    except CliError as e:
        sub = next((a for a in args if not a.startswith("-")), "")
        print(f"overshoot {sub}: error: {e}" if sub else f"overshoot: error: {e}", file=sys.stderr)
        return e.code
    except (typer.Abort, KeyboardInterrupt):
        print("overshoot: aborted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    return result if isinstance(result, int) else 0


def _where(e) -> str:
    ctx = getattr(e, "ctx", None)
    return f"overshoot {ctx.info_name}" if ctx is not None and ctx.parent is not None else "overshoot"


def _no_such_option(e) -> str:
    """click suggests any option loosely alike ("--bogus": "Did you mean --out?"); suggest only a close
    misspelling or a unique completion of a prefix."""
    import difflib

    name = e.option_name
    ctx = getattr(e, "ctx", None)
    known = [o for p in ctx.command.params for o in (*p.opts, *p.secondary_opts)] if ctx else []
    known = [o for o in known if o.startswith("--")] or list(e.possibilities or [])
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    completions = [o for o in known if len(name) > 3 and o.startswith(name)]
    hint = close[0] if close else (completions[0] if len(completions) == 1 else None)
    return f"no such option: {name}" + (f" (did you mean {hint}?)" if hint else "")


if __name__ == "__main__":
    sys.exit(main())
