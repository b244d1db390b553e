"""Gradient accumulation without `no_sync`: reductions that no optimizer step follows.

A loop that accumulates gradients over micro-batches without ``ddp.no_sync()`` is legal in
plain DDP (it reduces every micro-batch: slower, the same result), but DDP calls the hook, and
the fabric counts a step, on every micro-batch: the phases run that many times too fast, the
monitor judges partial gradients, and a low-bit route compresses the part of ``.grad`` already
reduced once more. Nothing in the hook tells a micro-batch from a step; the optimizer does. A
global optimizer step hook (``torch.optim``'s, held weakly) counts the steps of optimizers over
the model's parameters, and at each reduction the witness notes whether one came since the
last. Half a window or more without one, in `RUNS` or more separate runs, is several
reductions per optimizer step: accumulation (two micro-batches a step: 16 runs of one), or
several backward passes per step by design (SAM, a GAN's generator loss through a DDP
discriminator), which the fabric counts as steps too. One long run is not: a rank that joined
early under `Join` (uneven inputs) reduces zeros without stepping until the others are done.
A `GradScaler` that skips steps reads the same way while its skips fall in 4 or more runs
of 16 in a window, which a healthy run's few skips at the start never do.

Not seen: optimizers outside ``torch.optim.Optimizer``; reductions before the first step of one
over the model's parameters (a run that never steps one is never judged); parameters an
optimizer gained by ``add_param_group`` after its first step (ownership is decided then);
accumulation over 15 or more micro-batches (3 runs or fewer in any window; over 11-14 it is
found once a window holds 4).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

#: reductions judged together; how many of them without an optimizer step after them, in how
#: many separate runs, mean several per step (2 micro-batches a step: 16 of 32, in 16 runs)
WINDOW = 32
UNSTEPPED = 16
RUNS = 4


class StepWitness:
    """Whether the reductions of one fabric state are followed by optimizer steps."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._ids = frozenset(id(p) for p in params)
        # per optimizer, whether it steps any of the parameters (decided at its first step)
        self._owns: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self.steps = 0  # optimizer steps over the parameters since attach
        self._at_last: int | None = None  # `steps` at the last reduction
        self._unstepped: deque[bool] = deque(maxlen=WINDOW)
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

    def reduction(self) -> int | None:
        """Note a reduction (a step's first bucket). Returns, once, how many of the last
        `WINDOW` reductions no optimizer step followed, when that is `UNSTEPPED` or more in
        `RUNS` or more separate runs."""
        if not self._remove.alive:  # judged (or closed): nothing more to note
            return None
        if self._at_last is not None and self.steps > 0:  # (judged from the first step on)
            self._unstepped.append(self.steps == self._at_last)
        self._at_last = self.steps
        if len(self._unstepped) < WINDOW:
            return None
        marks = list(self._unstepped)
        unstepped = sum(marks)
        runs = sum(m and not before for before, m in zip([False, *marks[:-1]], marks, strict=True))
        if unstepped < UNSTEPPED or runs < RUNS:
            return None
        self._remove()  # said once: the global hook stops counting
        return unstepped

    def close(self) -> None:
        """Stop counting (the state closed)."""
        self._remove()


#: what the total_steps warnings add (`FabricState`): the cause this module looks for
NO_SYNC_HINT = ("with gradient accumulation, total_steps counts optimizer steps, not "
                "micro-batches, and DDP reduces once per optimizer step only under "
                "ddp.no_sync()")


def accumulation_warning(unstepped: int) -> str:
    """The line for `StepWitness.reduction`'s finding."""
    return (f"nfabric: {unstepped} of the last {WINDOW} reductions had no optimizer step after "
            "them, and nfabric counts each reduction as a step (phases placed by total_steps "
            "run that many times too fast): gradient accumulation without ddp.no_sync()? Then "
            "low-bit routes also compress the part of .grad already reduced again: run every "
            "micro-batch but the last under `with ddp.no_sync():`. Several backward passes per "
            "step by design (SAM, a GAN): pass total_steps in reductions")
