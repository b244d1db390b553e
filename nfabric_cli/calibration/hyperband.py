"""Hyperband's shape over a trial's checkpoints, and the Optuna pruner it makes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HyperbandShape:
    """Hyperband over a trial's checkpoints. Bracket s first judges a trial at checkpoint
    ``min_resource * reduction_factor**s`` and again every `reduction_factor` times later,
    keeping the best 1/`reduction_factor` of the trials its bracket has judged there; more
    brackets hedge against misleading early checkpoints at the cost of later first cuts."""

    min_resource: int
    reduction_factor: int
    brackets: int
    checkpoints: int  # a trial's checkpoints: the most resource it can use

    @property
    def max_brackets(self) -> int:
        """Brackets whose first cut falls on a checkpoint (Optuna's count for max_resource =
        checkpoints), at least 1."""
        count, first = 0, self.min_resource
        while first <= self.checkpoints:
            count, first = count + 1, first * self.reduction_factor
        return max(count, 1)

    def pruner(self) -> Any:
        """Optuna's HyperbandPruner with this shape. Optuna counts brackets from max_resource
        alone (its rungs never look at it), so fewer brackets than the checkpoints allow are
        asked for with the largest max_resource that gives that count."""
        import optuna  # here, so parsing a spec does not import optuna

        top = self.checkpoints
        if self.brackets < self.max_brackets:
            top = self.min_resource * self.reduction_factor**self.brackets - 1
        return optuna.pruners.HyperbandPruner(
            min_resource=self.min_resource, max_resource=top,
            reduction_factor=self.reduction_factor,
        )

    def label(self) -> str:
        """How the profile's provenance records it."""
        return (f"hyperband(min_resource={self.min_resource}, "
                f"reduction_factor={self.reduction_factor}, brackets={self.brackets}, "
                f"checkpoints={self.checkpoints})")
