"""Error feedback: the residual of lossy compression, kept per parameter and added back.

g' = g + r;  send route(g');  r <- g' - decode(encode(g')) with local scales.
Residuals are keyed by parameter name (they survive DDP's bucket rebuild) and dropped when a
parameter changes route, since a residual of one codec means nothing to another.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ErrorFeedback:
    """Per-parameter residual memory.

    A route reduces a group of parameters as one flat tensor, so the group calls
    (`compensate_flat`, `update_flat`) keep each group's residuals in one flat tensor too
    (each parameter's residual a view of it): compensating a group the same parameters formed
    at the last update is one add, not one per parameter. The values are the per-parameter
    ones bit for bit (elementwise adds either way)."""

    __slots__ = ("_flat", "_owner", "_residual", "_route")

    def __init__(self) -> None:
        self._residual: dict[str, torch.Tensor] = {}
        self._route: dict[str, str] = {}
        self._owner: dict[str, tuple[str, ...]] = {}  # the group whose flat residual holds it
        self._flat: dict[tuple[str, ...], torch.Tensor] = {}

    def compensate(self, name: str, route_label: str, grad: torch.Tensor) -> torch.Tensor:
        """Return grad + residual (a new tensor); resets the residual if the route changed."""
        if self._route.get(name) != route_label:
            self._drop(name)
            self._route[name] = route_label
        r = self._residual.get(name)
        return grad + r if r is not None else grad.clone()

    def update(self, name: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Store what compression lost locally: compensated - decode(encode(compensated))."""
        self._drop(name)
        self._residual[name] = compensated - sent

    def compensate_flat(
        self, names: Sequence[str], route_label: str, grads: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """cat(grad + residual) over a group of parameters (a new tensor), in the dtype
        `compensate`'s per-parameter adds promote to: a bf16 gradient plus its float32
        residual is float32 either way (added into a bf16 copy, the residual was rounded
        away, and a resumed run, whose first step takes the per-parameter path, differed)."""
        key = tuple(names)
        flat = self._flat.get(key)
        if flat is not None and all(
            self._owner.get(n) == key and self._route.get(n) == route_label for n in names
        ):
            dtype = torch.promote_types(grads[0].dtype, flat.dtype)
            out = (torch.cat(list(grads)).to(dtype) if len(grads) > 1
                   else grads[0].to(dtype, copy=True))
            return out.add_(flat)
        parts = [self.compensate(n, route_label, g) for n, g in zip(names, grads, strict=True)]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def update_flat(
        self,
        names: Sequence[str],
        compensated: torch.Tensor,
        sent: torch.Tensor,
        numels: Sequence[int],
    ) -> None:
        """`update` for a group compensated with `compensate_flat`: one subtraction."""
        key = tuple(names)
        residual = compensated - sent
        for n in names:
            self._drop(n)
        for n, piece in zip(names, residual.split(list(numels)), strict=True):
            self._residual[n] = piece
            self._owner[n] = key
        self._flat[key] = residual

    def _drop(self, name: str) -> None:
        """Forget `name`'s residual (and the flat tensor of the group that held it)."""
        self._residual.pop(name, None)
        owner = self._owner.pop(name, None)
        if owner is not None:
            self._flat.pop(owner, None)

    def reset(self, name: str | None = None) -> None:
        if name is None:
            self._residual.clear()
            self._route.clear()
            self._owner.clear()
            self._flat.clear()
        else:
            self._drop(name)
            self._route.pop(name, None)

    def state_dict(self) -> dict[str, dict]:
        """Residuals (CPU copies) and the route each was made for, by parameter name."""
        return {"residual": {n: r.detach().cpu().clone() for n, r in self._residual.items()},
                "route": dict(self._route)}

    def load_state_dict(self, state: dict[str, dict], device: torch.device | None = None) -> None:
        """Restore residuals (onto `device`); groups re-form their flat tensors at the next
        update, with the same values."""
        self.reset()
        self._route = dict(state["route"])
        self._residual = {n: r.to(device) if device is not None else r.clone()
                          for n, r in state["residual"].items()}

    def residual(self, name: str) -> torch.Tensor | None:
        return self._residual.get(name)

    def __len__(self) -> int:
        return len(self._residual)
