"""`replay_trace`: replay a trace on real ranks, fit the substrate, compare with the model.

Flow: load and check the trace -> plan (groups, fp32 twins, fp32 and codec size sweeps) ->
run the ranks (optionally behind a shaped link) -> per case, the median over repeats of the
slowest rank's seconds, each rank's codec stages and collectives -> fit α, β from every fp32
all-reduce; codec rates and fixed costs per call, then the per-kind latencies, from the codec
sweeps; the endpoint's ingress from the central gathers -> a `Substrate` -> predicted vs
measured per recorded group (out of sample for codec and per-kind latency), and the gate's
verdict against what was measured.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nfabric_cli.errors import InputError
from nfabric_cli.replay.fit import (
    LinkFit,
    OpSample,
    ReduceSample,
    StageSample,
    fit_codec,
    fit_endpoint,
    fit_kind_latency,
    fit_link,
)
from nfabric_cli.replay.plan import ROLE_CODEC, ROLE_SWEEP, ROLE_TRACE, ReplayPlan, build_plan
from nfabric_cli.replay.timed import Stages, split_stages
from nfabric_cli.replay.trace import Trace, load_payload, load_trace
from nfabric_cli.substrate.cost import bucket_verdict, codec_seconds, predict_route
from nfabric_cli.substrate.model import Substrate, save_substrate


@dataclass(frozen=True)
class CaseResult:
    """One replayed case, aggregated over ranks and repeats."""

    index: int
    measured_s: float  # median over repeats of the slowest rank
    stages: Stages  # per stage, the slowest rank's median
    ops: tuple[tuple[str, int, float], ...]  # rank 0: (kind, payload bytes, median seconds)
    inputs: dict[str, int]  # "payload" / "random" -> ranks
    op_medians: tuple[float, ...] = ()  # per collective: median over ranks of its median


@dataclass
class ReplayReport:
    """What a replay measured and fitted; `groups` compares each trace group (see
    `compare_groups`)."""

    trace: Trace
    plan: ReplayPlan
    link: LinkFit
    substrate: Substrate
    results: list[CaseResult]
    shared_link: bool
    out: Path | None = None
    groups: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The `--json` document (keys in docs/replay.md)."""
        sweep, codec_sweep = [], []
        for r in self.results:
            case = self.plan.cases[r.index]
            pred = predict_route(case.route, case.numel, self.plan.world_size, self.substrate)
            row = {"numel": case.numel, "measured_s": r.measured_s, "predicted_s": pred}
            if case.role == ROLE_SWEEP:
                sweep.append(row)
            elif case.role == ROLE_CODEC:
                codec_sweep.append({"route": case.route.label(), **row})
        return {
            "trace": str(self.trace.directory), "trace_world_size": self.trace.world_size,
            "world_size": self.plan.world_size, "topology": self.plan.topology,
            "link_mbit": self.plan.link_mbit, "repeats": self.plan.repeats,
            "shared_link": self.shared_link,
            "fit": {"alpha_s": self.link.alpha_s, "beta_s_per_byte": self.link.beta_s_per_byte,
                    "link_gbps": self.link.link_gbps, "rms_rel_error": self.link.rms_rel_error,
                    "samples": self.link.samples,
                    "endpoint_gbps": self.substrate.endpoint_gbps,
                    "encode_gbps": self.substrate.encode_gbps,
                    "reduce_gbps": self.substrate.reduce_gbps,
                    "decode_gbps": self.substrate.decode_gbps,
                    "codec_call_us": self.substrate.codec_call_us,
                    "latency_us_by_kind": self.substrate.latency_us_by_kind},
            "groups": self.groups, "sweep": sweep, "codec_sweep": codec_sweep,
            "warnings": self.warnings,
            "substrate": self.substrate.to_dict(),
            "out": None if self.out is None else str(self.out),
        }


def replay_trace(
    directory: str | Path,
    world_size: int | None = None,
    topology: str | None = None,
    link_mbit: float | None = None,
    repeats: int = 5,
    out: str | Path | None = None,
    shared_link: bool = True,
) -> ReplayReport:
    """Replay the trace in `directory`, fit a substrate, write it to `out` (if given).

    ``shared_link``: every rank's bytes cross one link. True for any replay on one host
    (the ranks share its loopback, shaped or not); the fitted β then belongs to that link.
    Bad input raises `InputError` before any rank starts; a failed rank raises `CheckFailed`.
    """
    from nfabric_cli.replay.launch import run_ranks

    if link_mbit is not None:
        from nfabric_cli.ranks.netns import link_available

        reason = link_available()
        if reason:
            raise InputError(reason)
    trace = load_trace(directory)
    plan = build_plan(trace, world_size, topology, repeats, link_mbit)
    warnings = check_payloads(plan)
    results = aggregate(plan, run_ranks(plan))
    report = fit_report(trace, plan, results, shared_link, out)
    report.warnings = warnings
    return report


def check_payloads(plan: ReplayPlan) -> list[str]:
    """Why each payload sample a replay rank would read is unusable (random data of the
    recorded size stands in for it); empty when every sample is good."""
    problems = []
    for case in plan.cases:
        for rel in sorted({case.payload_for(r) for r in range(plan.world_size)} - {None}):
            _, why = load_payload(Path(plan.trace_dir), rel, case.numel, mmap=True)
            if why:
                problems.append(f"payload {why}: random data used")
    return problems


def aggregate(plan: ReplayPlan, ranks: list[dict[str, Any]]) -> list[CaseResult]:
    """Per case: the slowest rank's seconds per repeat (median), stages, rank 0's collectives."""
    out = []
    for i in range(len(plan.cases)):
        per_rank = [r["cases"][i] for r in ranks]
        repeats = len(per_rank[0]["seconds"])
        slowest = [max(r["seconds"][k] for r in per_rank) for k in range(repeats)]
        stage_meds = []
        for r in per_rank:
            split = [split_stages(ev, s) for ev, s in zip(r["events"], r["seconds"], strict=True)]
            stage_meds.append(Stages(*(statistics.median(x) for x in zip(*split, strict=True))))
        stages = Stages(*(max(x) for x in zip(*stage_meds, strict=True)))
        durations = [[statistics.median(rep[j][3] - rep[j][2] for rep in r["events"])
                      for j in range(len(r["events"][0]))] if r["events"] else []
                     for r in per_rank]
        root = per_rank[0]["events"]
        ops = tuple((kind, int(nbytes), durations[0][j])
                    for j, (kind, nbytes, *_rest) in enumerate(root[0])) if root else ()
        medians = tuple(statistics.median(d[j] for d in durations) for j in range(len(ops)))
        inputs: dict[str, int] = {}
        for r in per_rank:
            inputs[r["input"]] = inputs.get(r["input"], 0) + 1
        out.append(CaseResult(i, statistics.median(slowest), stages, ops, inputs, medians))
    return out


def fit_report(
    trace: Trace,
    plan: ReplayPlan,
    results: list[CaseResult],
    shared_link: bool,
    out: str | Path | None,
) -> ReplayReport:
    """Fit the substrate from aggregated results, compare every trace group, write `out`."""
    sub, link = fit_substrate(plan, results, shared_link)
    report = ReplayReport(trace, plan, link, sub, results, shared_link)
    report.groups = compare_groups(plan, results, sub)
    if out is not None:
        save_substrate(sub, out)
        report.out = Path(out)
    return report


def fit_substrate(
    plan: ReplayPlan, results: list[CaseResult], shared_link: bool
) -> tuple[Substrate, LinkFit]:
    """The fitted substrate (see module doc) and the link fit behind it.

    Codec and per-kind latency come from the codec sweeps (`ROLE_CODEC`); a plan without any
    (written before them) fits them from the compressed trace groups instead."""
    w = plan.world_size
    fp32 = [OpSample("allreduce", 4 * plan.cases[r.index].numel, w, r.measured_s)
            for r in results if plan.cases[r.index].route.name == "fp32"]
    link = fit_link(fp32, shared_link)
    coded = [r for r in results if plan.cases[r.index].route.name != "fp32"]
    fitted = [r for r in coded if plan.cases[r.index].role == ROLE_CODEC] or coded
    codec = fit_codec(stage_samples(plan, fitted))
    gathers = [OpSample(k, n, w, s) for r in coded for k, n, s in r.ops if k == "gather"]
    endpoint = fit_endpoint(gathers, link)
    sub = Substrate(
        link_gbps=_sig(link.link_gbps), latency_us=_sig(link.alpha_s * 1e6),
        topology=plan.topology, world_size=w, shared_link=shared_link,
        endpoint_gbps=None if endpoint is None else _sig(endpoint * 8 / 1e9),
        alpha_s=_sig(link.alpha_s), beta_s_per_byte=_sig(link.beta_s_per_byte),
        codec_call_us={route: _sig(us) for route, us in codec.call_us.items()},
        **{table: {route: _sig(v) for route, v in rates.items()}
           for table, rates in codec.rates.items() if rates},
    )
    reduces = []
    for r in fitted:
        case = plan.cases[r.index]
        ops = tuple(OpSample(k, n, w, d) for (k, n, _), d in zip(r.ops, r.op_medians, strict=True))
        reduces.append(ReduceSample(w, r.measured_s,
                                    codec_seconds(case.route, case.numel, w, sub), ops))
    kinds = fit_kind_latency(reduces, link, shared_link)
    return replace(sub, latency_us_by_kind={k: _sig(v * 1e6) for k, v in kinds.items()}), link


def stage_samples(plan: ReplayPlan, results: list[CaseResult]) -> list[StageSample]:
    """The codec stages of replayed compressed reduces, as `fit_codec` takes them."""
    out = []
    for r in results:
        case = plan.cases[r.index]
        spec = case.route
        out.append(StageSample(spec.name, spec.reducer, spec.lowbit, case.numel,
                               plan.world_size, *r.stages[:3]))
    return out


def compare_groups(
    plan: ReplayPlan, results: list[CaseResult], sub: Substrate
) -> list[dict[str, Any]]:
    """Per trace group: measured vs predicted (route and its fp32 twin), the gate's verdict
    and the verdict the measured times give (low-bit faster than fp32 by the margin)."""
    w = plan.world_size
    twin = {plan.cases[r.index].twin_of: r for r in results if plan.cases[r.index].twin_of is not None}
    rows = []
    for r in results:
        case = plan.cases[r.index]
        if case.role != ROLE_TRACE:
            continue
        spec = case.route
        pred = predict_route(spec, case.numel, w, sub)
        row: dict[str, Any] = {
            "route": spec.label(), "numel": case.numel, "segments": len(case.segments),
            "inputs": r.inputs, "recorded_s": case.recorded_s, "measured_s": r.measured_s,
            "predicted_s": pred, "error": pred / r.measured_s - 1.0,
            "stages_s": r.stages._asdict(),
        }
        t = twin.get(r.index)
        if t is not None:
            fp32_pred = predict_route(plan.cases[t.index].route, case.numel, w, sub)
            verdict = bucket_verdict(sub, {spec: case.numel}, w)
            measured_admit = r.measured_s < t.measured_s * (1.0 - sub.margin)
            row.update({
                "fp32_measured_s": t.measured_s, "fp32_predicted_s": fp32_pred,
                "fp32_error": fp32_pred / t.measured_s - 1.0,
                "measured_speedup": t.measured_s / r.measured_s,
                "verdict": verdict.verdict, "reason": verdict.reason,
                "measured_verdict": "admit" if measured_admit else "fallback",
            })
            row["agrees"] = row["verdict"] == row["measured_verdict"]
        rows.append(row)
    return rows


def _sig(x: float, digits: int = 4) -> float:
    """`x` to `digits` significant digits: fitted constants are not known better than that."""
    return float(f"{x:.{digits}g}")
