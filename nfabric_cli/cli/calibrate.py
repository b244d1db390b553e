"""`nfabric calibrate WORKLOAD`: search precision per region and phase, write a profile."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from nfabric_cli.atomic import check_writable
from nfabric_cli.cli.common import console, err_console, handle_errors, print_json
from nfabric_cli.errors import InputError


class QuietInterrupt(logging.Filter):
    """Drops Optuna's report of a trial stopped by Ctrl-C (a traceback, then "failed with
    value None"): the one-line "interrupted" says it, the storage keeps the trial as failed
    and a rerun resumes the study. Other failures are still reported."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupted: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0] if record.exc_info else None
        message = record.getMessage()
        trial = message.split(" ")[1] if message.startswith("Trial ") else ""
        if exc is not None and issubclass(exc, KeyboardInterrupt):
            self.interrupted.add(trial)
            return False
        if "error: Dropped(" in message:  # said already, in one line, by the progress sink
            return False
        return not (trial in self.interrupted and " failed with value " in message)


def register(app: typer.Typer) -> None:
    app.command("calibrate")(calibrate_cmd)


@handle_errors
def calibrate_cmd(
    workload: str = typer.Argument(None, help="Built-in workload (vision, transformer, lm, glyphs) or "
                                   "MODULE:FN (optional with --status --study)."),
    workload_opt: str = typer.Option(None, "--workload", help="The workload, as the other "
                                     "commands take it (same as the argument)."),
    spec: Path = typer.Option(None, "--spec", help="Calibration spec (default calibrate/<workload>.toml)."),
    world_size: int = typer.Option(None, "--world-size", help="Simulated ranks (overrides the spec)."),
    trials: int = typer.Option(None, "--trials", help="The study's trial budget: workers stop "
                               "when the study holds this many finished trials, all workers' "
                               "together (a larger number extends a finished study)."),
    steps: int = typer.Option(None, "--steps", help="Training steps per trial."),
    sampler: str = typer.Option(None, "--sampler", help="tpe, nsga2 or random."),
    pruner: str = typer.Option(None, "--pruner", help="hyperband, median or none."),
    storage: str = typer.Option(None, "--storage", help="Optuna storage URL or journal:PATH "
                                "(default sqlite:///.nfabric/studies.db)."),
    study: str = typer.Option(None, "--study", help="Study name (default <workload>-w<W>-s<seed>)."),
    seed: int = typer.Option(None, "--seed", help="Seed for weights, data order and the sampler."),
    tolerance: float = typer.Option(None, "--tolerance", help="Allowed metric drop vs FP32."),
    out: Path = typer.Option(Path("profiles"), "--out", help="Profile root: OUT/<workload>/."),
    data_dir: str = typer.Option(None, "--data-dir", help="Data directory for the workload."),
    substrate: Path = typer.Option(None, "--substrate", help="Substrate TOML (e.g. from "
                                   "`nfabric replay`): the capacity gate prices every bucket on "
                                   "it during the search, and the profile carries it."),
    processes: int = typer.Option(None, "--processes", help="Processes computing the simulated "
                                  "ranks' gradients (default: one per CPU, at most the world "
                                  "size); results are identical for any value."),
    no_write: bool = typer.Option(False, "--no-write", help="Only contribute trials to the "
                                  "study; leave the profile to another worker."),
    confirm_seeds: str = typer.Option(None, "--confirm-seeds", help="Seeds the leading "
                                      "candidates must also hold on (1-2, 1,3; 'none': no "
                                      "confirmation; overrides the spec's confirm seeds)."),
    confirm_steps: str = typer.Option(None, "--confirm-steps", help="Run lengths they must "
                                      "also hold at (300,600; 'none'; overrides the spec's confirm "
                                      "steps). Each seed x length is a cell: see "
                                      "docs/calibration.md, 'Confirmation'."),
    confirm_world_sizes: str = typer.Option(None, "--confirm-world-sizes", help="World sizes "
                                            "they must also hold at, besides --world-size "
                                            "(2,8; 'none'; overrides the spec's confirm world_sizes)."),
    confirm_rule: str = typer.Option(None, "--confirm-rule", help="worst (every cell within "
                                     "tolerance, validate's rule), bound (the 95 % "
                                     "prediction bound for one more seed within it) or "
                                     "validate (every cell, and the worst of the spec's "
                                     "validate_seeds more seeds within it at 95 %: "
                                     "docs/calibration.md, 'Confirmation')."),
    confirm_repairs: int = typer.Option(None, "--confirm-repairs", help="When no candidate "
                                        "holds: rounds that retrain the cheapest that failed "
                                        "with one region on fp32 (default 1; 0: none, so the "
                                        "profile is then all fp32)."),
    warm_starts: list[Path] = typer.Option(None, "--warm-start", help="A profile (an earlier "
                                           "version, say) whose routes the study trains first, "
                                           "as one trial of its budget (Optuna's enqueue_trial): "
                                           "a recalibration never misses the last winner. It "
                                           "must fit the spec's phases, regions and choices. "
                                           "Repeatable."),
    status: bool = typer.Option(False, "--status", help="Print the study's trials, best "
                                "admissible trial and workers, and exit (trains nothing)."),
    as_json: bool = typer.Option(False, "--json", help="Print {profile, trials, pruned, best, "
                                 "written_by} (with --status: the study's state)."),
) -> None:
    """Search routes per region and phase (Optuna); write the cheapest profile that holds.

    The FP32 reference, a sensitivity sweep, then the search; the profile goes to
    OUT/<workload>/<workload>.v<N>.parquet, with a PNG of the search.

    Several workers (machines, or processes) given the same --storage and --study share one
    study: the reference runs once, the budget is the study's, one of them writes the profile."""
    import optuna

    from nfabric_cli.binding.fingerprint import model_fingerprint
    from nfabric_cli.calibration import calibrate
    from nfabric_cli.calibration.spec import run_spec
    from nfabric_cli.workloads.registry import get_workload

    if workload_opt is not None:
        if workload is not None and workload != workload_opt:
            raise InputError(f"two workloads given: {workload!r} and --workload {workload_opt!r}")
        workload = workload_opt
    if status and workload is None:
        if study is None:
            raise InputError("--status needs --study NAME (or a workload, for its default study)")
        return _status(storage, study, as_json)
    if workload is None:
        raise InputError("missing WORKLOAD: a built-in (vision, transformer, lm, glyphs) or MODULE:FN")

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optimize_log = logging.getLogger("optuna.study._optimize")
    if not any(isinstance(f, QuietInterrupt) for f in optimize_log.filters):
        optimize_log.addFilter(QuietInterrupt())
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    if processes is not None and processes < 1:
        raise InputError(f"--processes must be >= 1, got {processes}")
    if out.exists() and not out.is_dir():  # found before training, not after it
        raise InputError(f"--out {out}: is a file; calibrate writes OUT/<workload>/"
                         "<workload>.v<N>.parquet under a directory")
    wl = get_workload(workload, data_dir)
    if not (no_write or status):
        check_writable(out / wl.name, "--out", folder=True)
    cal = run_spec(wl, spec, steps=steps, sampler=sampler, pruner=pruner, substrate=substrate,
                   world_size=world_size, trials=trials, seed=seed, tolerance=tolerance,
                   confirm_seeds=_unless_none(confirm_seeds, _seeds),
                   confirm_steps=_unless_none(confirm_steps, _lengths),
                   confirm_world_sizes=_unless_none(confirm_world_sizes, _world_sizes),
                   confirm_rule=confirm_rule, confirm_repairs=confirm_repairs)
    if status:
        from nfabric_cli.calibration.strategy import default_study_name

        return _status(storage, study or default_study_name(cal, wl.name), as_json)
    offer = (out / wl.name).is_dir()  # a profile there may be offered as a warm start
    model = model_fingerprint(wl.build_model(cal.seed)) if warm_starts or offer else ""
    warm = _warm_starts(cal, warm_starts or [], model)
    if not warm:
        _hint_warm_start(cal, out / wl.name, model)
    if as_json:
        _, outcome = calibrate(wl, cal, storage, study, out, processes=processes,
                               write=not no_write, warm=warm)
        print_json({"profile": None if outcome.path is None else str(outcome.path),
                    "trials": outcome.trials, "pruned": outcome.pruned, "best": outcome.best,
                    "written_by": outcome.written_by})
        return
    with _RichSink(cal.trials) as sink:
        run, outcome = calibrate(wl, cal, storage, study, out, sink, processes=processes,
                                 write=not no_write, warm=warm)
    console.print(_summary(outcome, run.study.study_name))
    console.print(_routes(outcome.best))
    if "confirmation" in outcome.best:
        console.print(_confirmation(outcome.best["confirmation"]))
    if "note" in outcome.best:
        console.print(outcome.best["note"], highlight=False, soft_wrap=True)
    if outcome.pareto:
        console.print(_pareto(outcome.pareto))
    if outcome.path is None:
        console.print(f"profile: not written here ({outcome.note})", highlight=False,
                      soft_wrap=True)
    else:
        by = "" if outcome.written_by == run.worker.id else f" (written by {outcome.written_by})"
        console.print(f"profile: {outcome.path}{by}\nsearch plot: {outcome.png}", highlight=False,
                      soft_wrap=True)


def _warm_starts(cal: Any, paths: list[Path], model: str) -> list[Any]:
    """Each --warm-start profile as a config of `cal`'s search (InputError where one does not
    fit), with a warning per option the trial trains otherwise than the profile says, and
    when it was calibrated for another model (fingerprint `model` is this workload's): its
    routes are read by region, whatever they were proven on."""
    found = []
    for given in paths:
        w = _read_warm_start(cal, given)
        other = ((f"it was calibrated for another model (fingerprint {w.model}, this "
                  f"workload's {model}): its routes are taken by region name",)
                 if w.model and w.model != model else ())
        for note in (*other, *w.notes):
            err_console.print(f"[yellow]warning[/]: --warm-start {w.source}: {note}",
                              highlight=False, soft_wrap=True)
        found.append(w)
    return found


def _read_warm_start(cal: Any, given: Path) -> Any:
    """A profile file, or a folder's newest, as a `WarmStart` of `cal`'s search."""
    from nfabric_cli.calibration.warm import warm_start
    from nfabric_cli.profile.store import read_profile, resolve_profile

    path = resolve_profile(given)
    return warm_start(cal, read_profile(path), str(path))


def _hint_warm_start(cal: Any, folder: Path, model: str) -> None:
    """Say so when OUT holds a profile of this workload's model (fingerprint `model`; not
    another plugin's of the same name) that fits the search: a recalibration can train its
    routes first. Only a note: nothing changes unless asked."""
    if not folder.is_dir():
        return
    try:
        w = _read_warm_start(cal, folder)
    except (InputError, OSError):  # none, several newest, unreadable, or unfit: no note
        return
    if w.model and w.model != model:
        return
    path = w.source
    err_console.print(f"note: {path} exists; --warm-start {folder} would train its routes "
                      "first (docs/calibration.md, 'Warm starts')", highlight=False,
                      soft_wrap=True)


def _unless_none(text: str | None, parse: Any) -> tuple[int, ...] | None:
    """A confirmation flag: None when not given (the spec's value stands), () for 'none'."""
    if text is None:
        return None
    return () if text.strip().lower() == "none" else tuple(parse(text))


def _seeds(text: str) -> list[int]:
    from nfabric_cli.validation.seeds import parse_seeds

    return parse_seeds(text, "--confirm-seeds")


def _lengths(text: str) -> list[int]:
    return _int_list(text, "--confirm-steps", "lengths like 300,600")


def _world_sizes(text: str) -> list[int]:
    return _int_list(text, "--confirm-world-sizes", "world sizes like 2,8")


def _int_list(text: str, flag: str, example: str) -> list[int]:
    """Comma-separated integers, first occurrence kept; the spec checks their range."""
    try:
        found = list(dict.fromkeys(int(p) for p in text.split(",") if p.strip()))
    except ValueError:
        found = []
    if not found:  # (an empty list is spelled none, not '')
        raise InputError(f"{flag}: expected {example} or none, got {text!r}")
    return found


def _status(storage: str | None, study: str, as_json: bool) -> None:
    from nfabric_cli.calibration.status import study_status
    from nfabric_cli.cli.calibrate_status import render_status

    state = study_status(storage, study)
    if as_json:
        print_json(state)
    else:
        render_status(state, console)


class _RichSink:
    """Progress bars: trials of this run, and the steps of the trial in flight."""

    def __init__(self, trials: int) -> None:
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=err_console, transient=False,
        )
        self.trials = self.progress.add_task("trials", total=trials)
        self.steps = self.progress.add_task("trial", total=1, visible=False)

    def __enter__(self) -> _RichSink:
        return self  # the bars appear with the first trial, not before a bad-input error

    def __exit__(self, *exc: Any) -> None:
        if self.progress.live.is_started:  # (stopping one never started prints a blank line)
            self.progress.stop()

    def trial_started(self, number: int | None, kind: str, steps: int) -> None:
        label = kind if number is None else f"trial {number} ({kind})"
        self.progress.start()
        self.progress.reset(self.steps, total=steps, description=label, visible=True)

    def step(self, done: int) -> None:
        self.progress.update(self.steps, completed=done)

    def note(self, message: str) -> None:
        self.progress.console.print(f"  {message}", highlight=False, soft_wrap=True)

    def trial_finished(self, record: dict[str, Any]) -> None:
        if (record.get("number") is not None and record.get("state") != "DROPPED"
                and record.get("kind") != "repair"):  # repairs are outside the budget
            self.progress.advance(self.trials)
        d = record.get("degradation")
        number = record.get("number")
        label = record.get("kind", "") + ("" if number is None else f" {number}")
        if "note" in record:
            self.progress.console.print(f"  {label} {record['state'].lower()}: {record['note']}",
                                        highlight=False, soft_wrap=True)
            return
        note = f" (reused trial {record['reused_from']})" if "reused_from" in record else ""
        self.progress.console.print(
            f"  {label} {record['state'].lower()}: traffic {record['traffic_fraction']:.4f}, "
            f"metric {record['metric']:.4f}, degradation {d:+.4f}{note}",
            highlight=False, soft_wrap=True,
        )


def _summary(outcome: Any, study: str) -> Table:
    best = outcome.best
    table = Table(title=f"calibration: study {study}")
    for col in ("trials", "pruned", "new", "train steps", "best traffic", "best metric", "delta vs fp32"):
        table.add_column(col, justify="right")
    table.add_row(
        str(outcome.trials), str(outcome.pruned), str(outcome.new_trials), f"{outcome.steps_spent:,}",
        f"{best['traffic_fraction']:.4f}", f"{best['metric']:.4f}", f"{best['metric_delta']:+.4f}",
    )
    return table


def _routes(best: dict[str, Any]) -> Table:
    table = Table(title=f"chosen routes (trial {best['trial']})")
    table.add_column("region@phase")
    table.add_column("route")
    for key, route in best["routes"].items():
        table.add_row(key, route)
    return table


def _confirmation(doc: dict[str, Any]) -> Table:
    from nfabric_cli.calibration.choice import judged_bound

    cost = doc["cost"]
    key = judged_bound(doc["rule"])  # for the worst of several seeds under `validate`
    table = Table(title=f"confirmation ({doc['rule']} rule): {len(doc['cells']) + 1} cells, "
                        f"{cost['runs']} runs, {cost['train_steps']:,} steps, "
                        f"{cost['wall_s'] / 60:.1f} min"
                        + (f"; bound95: for the worst of {doc['validate_seeds']} more seeds"
                           if key == "validate_bound95" else ""))
    home = doc["candidates"][0]["cells"][0].get("world_size") if doc["candidates"] else None
    last = "cells: seed/steps degradation (/wN: at N ranks)"
    for col in ("trial", "traffic", "status", "worst", "mean", "bound95", last):
        table.add_column(col, justify="left" if col == last else "right")
    for v in doc["candidates"]:
        cells = ", ".join(f"{_cell_label(c, home)} {c['degradation']:+.4f}" for c in v["cells"])
        bound = "-" if v.get(key) is None else f"{v[key]:+.4f}"
        trial = str(v["trial"])
        if "repair" in v:  # e.g. "8 (6, head fp32)"
            trial += f" ({v['repair']['of']}, {v['repair']['region']} fp32)"
        table.add_row(trial, f"{v['traffic_fraction']:.4f}", v["status"],
                      f"{v['worst_degradation']:+.4f}", f"{v['mean_degradation']:+.4f}", bound,
                      cells)
    return table


def _cell_label(cell: dict[str, Any], home: int | None) -> str:
    """seed/steps, with /W where the cell ran at a world size other than the search's."""
    world = cell.get("world_size")
    return f"{cell['seed']}/{cell['steps']}" + ("" if world in (None, home) else f"/w{world}")


def _pareto(front: list[dict[str, Any]]) -> Table:
    table = Table(title="Pareto front: traffic vs metric degradation")
    for col in ("trial", "traffic", "degradation"):
        table.add_column(col, justify="right")
    for p in front:
        table.add_row(str(p["trial"]), f"{p['traffic_fraction']:.4f}", f"{p['degradation']:+.4f}")
    return table
