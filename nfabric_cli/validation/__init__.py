"""Validation: short real DDP runs that prove a profile side by side with fp32, static low-bit
and PyTorch's own hooks (launch, per-rank loop, arms, baselines, report, shaped link).

Entry point: `run_validation(ValidateConfig(...))`; see `docs/validation.md`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ValidateConfig", "ValidationResult", "plan", "run_validation"]


def __getattr__(name: str) -> Any:
    # Lazy: a rank process imports `validation.worker` and should not pay for the report stack.
    if name == "ValidateConfig":
        from nfabric_cli.validation.config import ValidateConfig

        return ValidateConfig
    if name in ("ValidationResult", "plan", "run_validation"):
        from nfabric_cli.validation import run

        return getattr(run, name)
    raise AttributeError(name)
