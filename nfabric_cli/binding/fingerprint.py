"""Trainable parameters as DDP sees them, and the model fingerprint a profile is tied to.

DDP walks `named_modules()` and each module's own parameters, keeps those that require a
gradient and drops repeats of a shared (tied) tensor. We walk the same way, so the first
name of a tied parameter and the parameter order are DDP's; every other name it goes by is
kept as an alias so selectors can match it too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from torch import nn


@dataclass(frozen=True)
class TrainableParam:
    """One trainable tensor: its first name, all its names, and the module(s) owning it."""

    name: str
    aliases: tuple[str, ...]
    owners: tuple[nn.Module, ...] = field(compare=False, repr=False)
    param: nn.Parameter = field(compare=False, repr=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in self.param.shape)

    @property
    def numel(self) -> int:
        return int(self.param.numel())

    @property
    def dtype(self) -> str:
        return str(self.param.dtype).removeprefix("torch.")

    def owner_type_names(self) -> set[str]:
        """Class names of the owning modules and all their base classes."""
        return {c.__name__ for m in self.owners for c in type(m).__mro__}


def trainable_parameters(model: nn.Module) -> list[TrainableParam]:
    """Trainable parameters in DDP's order, tied tensors once (named by their first name)."""
    names: dict[int, list[str]] = {}
    owners: dict[int, list[nn.Module]] = {}
    tensors: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            key = id(param)
            full = f"{module_name}.{pname}" if module_name else pname
            tensors.setdefault(key, param)
            if full not in names.setdefault(key, []):
                names[key].append(full)
            if all(m is not module for m in owners.setdefault(key, [])):
                owners[key].append(module)
    return [
        TrainableParam(names[k][0], tuple(names[k]), tuple(owners[k]), tensors[k]) for k in names
    ]


def fingerprint_items(items: list[tuple[str, tuple[int, ...], str]]) -> str:
    """sha256 (16 hex digits) over sorted (name, shape, dtype) triples."""
    text = "\n".join(f"{n}|{','.join(map(str, s))}|{d}" for n, s, d in sorted(items))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint_of(params: list[TrainableParam]) -> str:
    """The fingerprint over the (name, shape, dtype) of `params`."""
    return fingerprint_items([(p.name, p.shape, p.dtype) for p in params])


def model_fingerprint(model: nn.Module) -> str:
    """The fingerprint of `model`'s trainable parameters (names, shapes, dtypes)."""
    return fingerprint_of(trainable_parameters(model))
