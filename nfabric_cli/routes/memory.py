"""Error feedback: the residual of lossy compression, kept per parameter and added back.

g' = g + r;  send route(g');  r <- g' - decode(encode(g')) with local scales.
Residuals are keyed by parameter name (they survive DDP's bucket rebuild) and dropped when a
parameter changes route, since a residual of one codec means nothing to another.
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    """Per-parameter residual memory."""

    __slots__ = ("_residual", "_route")

    def __init__(self) -> None:
        self._residual: dict[str, torch.Tensor] = {}
        self._route: dict[str, str] = {}

    def compensate(self, name: str, route_label: str, grad: torch.Tensor) -> torch.Tensor:
        """Return grad + residual (a new tensor); resets the residual if the route changed."""
        if self._route.get(name) != route_label:
            self._residual.pop(name, None)
            self._route[name] = route_label
        r = self._residual.get(name)
        return grad + r if r is not None else grad.clone()

    def update(self, name: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """Store what compression lost locally: compensated - decode(encode(compensated))."""
        self._residual[name] = compensated - sent

    def reset(self, name: str | None = None) -> None:
        if name is None:
            self._residual.clear()
            self._route.clear()
        else:
            self._residual.pop(name, None)
            self._route.pop(name, None)

    def residual(self, name: str) -> torch.Tensor | None:
        return self._residual.get(name)

    def __len__(self) -> int:
        return len(self._residual)
