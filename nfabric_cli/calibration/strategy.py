"""What decides which trials a study runs: its name, its seeded sampler and its pruner."""

from __future__ import annotations

import warnings

import optuna

from nfabric_cli.calibration.spec import CalibrationSpec


def default_study_name(spec: CalibrationSpec, workload: str) -> str:
    base = f"{workload}-w{spec.world_size}-s{spec.seed}"
    return f"{base}-nsga2" if spec.sampler == "nsga2" else base


def make_sampler(spec: CalibrationSpec, offset: int) -> optuna.samplers.BaseSampler:
    """Seeded sampler; `offset` (trials already in the study, plus the pid of a worker that
    joins others) keeps a resumed run or a second worker from replaying the same draws."""
    seed = (spec.seed * 100_003 + offset) % 2**32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if spec.sampler == "tpe":
            return optuna.samplers.TPESampler(
                seed=seed, multivariate=True, constant_liar=True,
                n_startup_trials=len(spec.regions) + 6,
            )
        if spec.sampler == "nsga2":
            return optuna.samplers.NSGAIISampler(seed=seed, population_size=8)
        return optuna.samplers.RandomSampler(seed=seed)


def make_pruner(spec: CalibrationSpec) -> optuna.pruners.BasePruner:
    if spec.sampler == "nsga2" or spec.pruner == "none":
        return optuna.pruners.NopPruner()
    if spec.pruner == "hyperband":
        return spec.hyperband_shape().pruner()
    return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1)


def pruner_label(spec: CalibrationSpec) -> str:
    """The pruner as the profile's provenance records it (Hyperband with its shape)."""
    if spec.sampler == "nsga2":
        return "none (multi-objective)"
    if spec.pruner == "hyperband":
        return spec.hyperband_shape().label()
    return spec.pruner
