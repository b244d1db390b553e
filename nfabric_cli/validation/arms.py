"""The arms of a validation run, each set up on one rank's fresh DDP model.

- ``fp32``: plain DDP, no hook: the reference. Its bytes are priced, not hooked: one fp32
  all-reduce per DDP bucket (`plan_buckets`, DDP's own assignment for this model and cap),
  which equals what the fabric meter books as the fp32 reference for the same buckets.
- ``static``: every parameter on the ``sign`` route, monitor and gate off (static low-bit).
- ``profile``: the given profile or bindings with the health monitor and the capacity gate.
- ``fp16`` / ``powersgd``: PyTorch's hooks (see `baselines.py`).

Every arm exposes the same small surface to the per-rank loop: `observe(loss)`,
`step_bytes()` (sent, received per step), `events`, `fp32_reference()`, `close()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from nfabric_cli.binding import compile_profile, load_bindings_or_profile, static_profile
from nfabric_cli.binding.buckets import plan_buckets
from nfabric_cli.binding.fingerprint import trainable_parameters
from nfabric_cli.routes.plan import op_wire_bytes
from nfabric_cli.runtime.inject import Injection

#: The route of the `static` arm: the cheapest low-bit route, everywhere.
STATIC_ROUTE = "sign"


@dataclass(frozen=True)
class ArmContext:
    """What every arm of one rank shares."""

    world_size: int
    rank: int
    steps: int
    seed: int
    source: str
    bucket_cap_mb: float | None
    injections: tuple[Injection, ...] = ()
    powersgd_rank: int = 2
    powersgd_start: int = 2
    trace_dir: str | None = None  # the profile arm records bucket traces here
    measure_gate: bool = False  # the profile arm's gate times both paths (`runtime/probe.py`)


class PlainArm:
    """fp32: DDP's own all-reduce; bytes priced per bucket, the same every step."""

    def __init__(self, ddp: DistributedDataParallel, ctx: ArmContext) -> None:
        params = trainable_parameters(ddp.module)
        size = {p.name: p.numel * p.param.element_size() for p in params}
        sent = received = 0
        for names in plan_buckets(params, ctx.bucket_cap_mb):
            wb = op_wire_bytes("allreduce", sum(size[n] for n in names), ctx.world_size, ctx.rank)
            sent, received = sent + wb.sent, received + wb.received
        self._per_step = (sent, received)
        self._steps = 0
        self.events: list[dict[str, Any]] = []

    def observe(self, loss: Any) -> None:
        self._steps += 1

    def step_bytes(self) -> tuple[list[int], list[int]]:
        return [self._per_step[0]] * self._steps, [self._per_step[1]] * self._steps

    def fp32_reference(self) -> int:
        return sum(self._per_step) * self._steps

    def close(self) -> None:
        pass


class FabricArm:
    """static / profile: the fabric hook via `attach` (with `validate --inject`'s faults)."""

    def __init__(
        self, ddp: DistributedDataParallel, ctx: ArmContext, bindings: Any, controlled: bool
    ) -> None:
        from nfabric_cli.runtime.attach import attach_with

        self.state = attach_with(
            ddp, bindings, ctx.steps, monitor=controlled,
            gate=("measure" if ctx.measure_gate else True) if controlled else False,
            injections=ctx.injections, seed=ctx.seed,
            trace_dir=ctx.trace_dir if controlled else None,
        )  # fmt: skip
        self.steps = ctx.steps

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.state.events

    def observe(self, loss: Any) -> None:
        self.state.observe(loss)

    def step_bytes(self) -> tuple[list[int], list[int]]:
        sent, received = [0] * self.state.step, [0] * self.state.step
        for row in self.state.meter.rows():
            if row.step < len(sent):
                sent[row.step] += row.sent
                received[row.step] += row.received
        return sent, received

    def fp32_reference(self) -> int:
        return self.state.meter.fp32_bytes()

    def close(self) -> None:
        self.state.close()


class HookArm:
    """fp16 / powersgd: a PyTorch hook wrapped by `metered_hook`."""

    def __init__(self, ddp: DistributedDataParallel, ctx: ArmContext, kind: str) -> None:
        from nfabric_cli.validation import baselines

        self.meter = baselines.HookByteMeter(ctx.world_size, ctx.rank)
        group = ddp.process_group
        if kind == "fp16":
            state = baselines.fp16_state(group, self.meter)
        else:
            state = baselines.powersgd_state(
                group, self.meter, ctx.powersgd_rank, ctx.powersgd_start, ctx.seed
            )
        ddp.register_comm_hook(state, baselines.metered_hook)
        self.events: list[dict[str, Any]] = []

    def observe(self, loss: Any) -> None:
        pass

    def step_bytes(self) -> tuple[list[int], list[int]]:
        return list(self.meter.sent), list(self.meter.received)

    def fp32_reference(self) -> None:
        return None

    def close(self) -> None:
        pass


def make_arm(name: str, ddp: DistributedDataParallel, ctx: ArmContext) -> Any:
    """Set up arm `name` on a fresh DDP model (before its first step)."""
    model = ddp.module
    if name == "fp32":
        return PlainArm(ddp, ctx)
    if name == "static":
        profile = static_profile(model, STATIC_ROUTE, world_size=ctx.world_size)
        bindings = compile_profile(
            profile, model, ctx.world_size, ctx.bucket_cap_mb, total_steps=ctx.steps,
            find_unused_parameters=bool(ddp.find_unused_parameters),
        )
        return FabricArm(ddp, ctx, bindings, controlled=False)
    if name == "profile":
        bindings = profile_bindings(ctx.source, model, ctx.world_size, ctx.steps,
                                    ctx.bucket_cap_mb, bool(ddp.find_unused_parameters))
        return FabricArm(ddp, ctx, bindings, controlled=True)
    return HookArm(ddp, ctx, name)


def profile_bindings(
    source: str, model: Any, world_size: int, steps: int, bucket_cap_mb: float | None,
    find_unused_parameters: bool = False,
) -> Any:
    """The profile arm's bindings: a bindings file as compiled, or a profile compiled for
    this model, world size, steps, DDP bucket cap and `find_unused_parameters` (InputError on
    a mismatch)."""
    return load_bindings_or_profile(
        source, model, world_size=world_size, total_steps=steps, bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=find_unused_parameters,
    )
