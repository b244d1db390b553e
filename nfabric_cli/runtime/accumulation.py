"""Gradient accumulation without `no_sync`: optimizer steps that each follow several reductions.

A loop that accumulates gradients over micro-batches without ``ddp.no_sync()`` is legal in
plain DDP (it reduces every micro-batch: slower, the same result), but DDP calls the hook, and
the fabric counts a step, on every micro-batch: the phases run that many times too fast, the
monitor judges partial gradients, and a low-bit route compresses the part of ``.grad`` already
reduced once more. Nothing in the hook tells a micro-batch from a step; the optimizer does. A global
optimizer step hook (``torch.optim``'s, held weakly) counts the steps of optimizers over the
model's parameters, and the witness measures each step's run: the reductions since the step
before. `RUNS` steps in a row after two or more reductions each are several reductions per
optimizer step: accumulation (k micro-batches a step: runs of k, found at reduction
``RUNS * k + 1``, whatever k), or several backward passes per step by design (SAM, a GAN's
generator loss through a DDP discriminator), which the fabric counts as steps too. A run no
step ends is never judged: a rank that joined early under `Join` (uneven inputs) reduces
zeros without stepping until the others are done. A `GradScaler` that skips a step (no
``optimizer.step()``) makes one run of two or more: its skips at the start of training make
one run, and a healthy run's later skips are far apart; only a skip before each of `RUNS` steps
in a row (the start's run among them) would read as accumulation. Several optimizers over the
model that step together end one run.

Not seen: optimizers outside ``torch.optim.Optimizer``; parameters an optimizer gained by
``add_param_group`` after its first step (ownership is decided then).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

#: optimizer steps in a row that each came after two or more reductions: several a step
RUNS = 4


class StepWitness:
    """Whether the reductions of one fabric state are followed by optimizer steps."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._ids = frozenset(id(p) for p in params)
        # per optimizer, whether it steps any of the parameters (decided at its first step)
        self._owns: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self.steps = 0  # optimizer steps over the parameters since attach
        self._at_last = 0  # `steps` at the last reduction
        self._run = 0  # reductions since the last optimizer step
        self._runs: list[int] = []  # the runs of the last steps in a row, each of two or more
        me = weakref.ref(self)  # the hook is global: it must not keep a closed state alive

        def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            witness = me()
            if witness is not None:
                witness._count(optimizer)

        # removed at `close`, once judged (said once), or with the witness (a state never
        # closed); alive while there is something to judge
        self._remove = weakref.finalize(self, register_optimizer_step_post_hook(hook).remove)

    def _count(self, optimizer: Any) -> None:
        # the hook runs inside every optimizer's step() in the process: it must never raise
        # there (an optimizer that cannot be a weak key, param_groups of another shape)
        try:
            owns = self._owns.get(optimizer)
            if owns is None:
                owns = any(id(p) in self._ids for g in optimizer.param_groups
                           for p in g["params"])
                self._owns[optimizer] = owns
        except Exception:  # noqa: BLE001 - not seen: never judged on it
            return
        if owns:
            self.steps += 1

    def reduction(self) -> list[int] | None:
        """Note a reduction (a step's first bucket). Returns, once, the runs (reductions per
        optimizer step) of the last `RUNS` steps when each was two or more."""
        if not self._remove.alive:  # judged (or closed): nothing more to note
            return None
        if self.steps != self._at_last:  # a step ended the run before this reduction
            self._runs = self._runs + [self._run] if self._run >= 2 else []
            self._run = 0
        self._at_last = self.steps
        self._run += 1
        if len(self._runs) < RUNS:
            return None
        self._remove()  # said once: the global hook stops counting
        return self._runs

    def close(self) -> None:
        """Stop counting (the state closed)."""
        self._remove()


#: what the total_steps warnings add (`FabricState`): the cause this module looks for
NO_SYNC_HINT = ("with gradient accumulation, total_steps counts optimizer steps, not "
                "micro-batches, and DDP reduces once per optimizer step only under "
                "ddp.no_sync()")


class AccumulationWarning(UserWarning):
    """Optimizer steps that each came after several reductions (`accumulation_warning`): its
    own category, so that a loop with several backward passes per step by design (a GAN's
    discriminator, SAM) can silence it alone, ``warnings.filterwarnings("ignore",
    category=nfabric_cli.AccumulationWarning)``."""


def accumulation_warning(runs: list[int]) -> str:
    """The line for `StepWitness.reduction`'s finding: the runs it found."""
    lo, hi = min(runs), max(runs)
    each = f"{lo}" if lo == hi else f"{lo} to {hi}"
    return (f"nfabric: each of the last {len(runs)} optimizer steps came after {each} "
            "reductions, and nfabric counts each reduction as a step (phases placed by "
            "total_steps run that many times too fast): gradient accumulation without "
            "ddp.no_sync()? Then low-bit routes also compress the part of .grad already "
            "reduced again: run every micro-batch but the last under `with ddp.no_sync():`. "
            "Several backward passes per step by design (SAM, a GAN): pass total_steps in "
            "reductions and filter nfabric_cli.AccumulationWarning")
