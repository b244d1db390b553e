"""Matching a profile to the model as the user holds it: wrapped, compiled, renamed or cast.

A profile records its model's fingerprint (names, shapes and dtypes of the trainable
parameters) and, in new profiles, the parameter list itself (`provenance.model_params`). The
usual wrappers change the names but not the model: DDP and DataParallel (`module.`),
`torch.compile` (`_orig_mod.`), a LightningModule or any module holding the network (`net.`,
`model.`); mixed precision changes the dtypes (`model.to(torch.bfloat16)`, Lightning's
`bf16-true`). So a profile matches a model when, after removing `_orig_mod.` segments and a
prefix shared by every name (on either side), the names and shapes agree; the dtypes may
differ (the bindings record the model's). Selectors then match the profile's names as well as
the user's own (each parameter gets the profile-side name as an alias). A real mismatch says
what differs: names, shapes, dtypes or counts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nfabric_cli.binding.fingerprint import TrainableParam, fingerprint_items, fingerprint_of
from nfabric_cli.errors import InputError

COMPILED = "_orig_mod."
FLOAT_DTYPES = ("float32", "bfloat16", "float16")
Item = tuple[str, tuple[int, ...], str]  # name, shape, dtype


def params_record(params: Sequence[TrainableParam]) -> list[list[Any]]:
    """What a profile records of its model: [name, shape, dtype] per trainable parameter."""
    return [[p.name, list(p.shape), p.dtype] for p in params]


@dataclass(frozen=True)
class ModelMatch:
    """How the model's names and dtypes map to the profile's."""

    names: dict[str, str]  # model name -> the profile's name for it
    stripped: str = ""  # prefix removed from the model's names
    added: str = ""  # prefix the profile's names carry that the model's lack
    compiled: bool = False  # `_orig_mod.` segments removed
    dtype: str | None = None  # "model bfloat16, profile float32" when they differ

    def notes(self) -> list[str]:
        out = []
        if self.compiled:
            out.append("removed torch.compile's '_orig_mod.' from the model's names")
        if self.stripped:
            out.append(f"stripped the prefix {self.stripped!r} from the model's names")
        if self.added:
            out.append(f"the profile's names carry the prefix {self.added!r}")
        if self.dtype:
            out.append(f"dtypes differ ({self.dtype}): bindings keep the model's")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"stripped": self.stripped, "added": self.added, "compiled": self.compiled,
                "dtype": self.dtype}

    def aliased(self, params: list[TrainableParam]) -> list[TrainableParam]:
        """`params` with each one's profile-side name as an extra alias (for selectors)."""
        out = []
        for p in params:
            other = self.names.get(p.name, p.name)
            out.append(p if other in p.aliases else replace(p, aliases=(*p.aliases, other)))
        return out


def _uncompile(name: str) -> str:
    return name.replace(COMPILED, "")


def _strip_levels(names: list[str]) -> Iterator[tuple[str, list[str]]]:
    """("", names), then each shared leading component removed in turn."""
    parts = [n.split(".") for n in names]
    yield "", names
    depth = 0
    while all(len(p) > depth + 1 for p in parts) and len({p[depth] for p in parts}) == 1:
        depth += 1
        yield ".".join(parts[0][:depth]) + ".", [".".join(p[depth:]) for p in parts]


def _name_variants(names: list[str]) -> Iterator[tuple[bool, str, list[str]]]:
    """(compiled, prefix stripped, names): without `_orig_mod.` first when names have it."""
    uncompiled = [_uncompile(n) for n in names]
    if uncompiled != names:
        yield from ((True, prefix, n) for prefix, n in _strip_levels(uncompiled))
    yield from ((False, prefix, n) for prefix, n in _strip_levels(names))


def _dtype_note(model: list[str], profile: list[str]) -> str | None:
    a, b = sorted(set(model)), sorted(set(profile))
    return None if a == b else f"model {'/'.join(a)}, profile {'/'.join(b)}"


def match_model(meta: dict[str, Any], params: list[TrainableParam]) -> ModelMatch:
    """How `params` match the profile described by `meta`; InputError when they do not."""
    real = [p.name for p in params]
    expected = meta.get("model_fingerprint")
    if not expected or fingerprint_of(params) == expected:
        return ModelMatch({n: n for n in real})
    recorded = (meta.get("provenance") or {}).get("model_params")
    if recorded:
        return _match_recorded(meta, params, [(str(n), tuple(s), str(d)) for n, s, d in recorded])
    shapes = [p.shape for p in params]
    dtypes = [p.dtype for p in params]
    for compiled, prefix, names in _name_variants(real):
        for dt in [None, *FLOAT_DTYPES]:
            cast = dtypes if dt is None else [dt if d in FLOAT_DTYPES else d for d in dtypes]
            if fingerprint_items(list(zip(names, shapes, cast, strict=True))) == expected:
                note = None if dt is None else _dtype_note(dtypes, cast)
                return ModelMatch(dict(zip(real, names, strict=True)), prefix, "", compiled, note)
    raise InputError(
        f"profile was made for another model ({meta.get('workload') or 'unknown workload'}, "
        f"fingerprint {expected}); this model has fingerprint {fingerprint_of(params)} over "
        f"{len(params)} trainable parameters ({', '.join(real[:3])}{', ...' if len(real) > 3 else ''})"
        " even without wrapper prefixes and with any float dtype (the profile does not list "
        "its parameters, so nothing more precise can be said)")


def _match_recorded(meta: dict[str, Any], params: list[TrainableParam],
                    recorded: list[Item]) -> ModelMatch:
    """Match against the profile's recorded parameter list: canonical names (no
    `_orig_mod.`, shared prefixes stripped on both sides) and shapes must agree."""
    real = [p.name for p in params]
    theirs = [n for n, _, _ in recorded]
    their_variants = list(_strip_levels([_uncompile(n) for n in theirs]))
    pairs = [(compiled, prefix, names, added, canon)
             for compiled, prefix, names in _name_variants(real)
             for added, canon in their_variants]
    exact = next((p for p in pairs if sorted(p[2]) == sorted(p[4])), None)
    if exact is None:
        _, prefix, names, added, canon = max(pairs, key=lambda p: len(set(p[2]) & set(p[4])))
        parts = [f"{len(params)} trainable parameters vs the profile's {len(recorded)}"]
        if only_model := sorted(set(names) - set(canon)):
            parts.append(f"only in the model: {_some([prefix + n for n in only_model])}")
        if only_profile := sorted(set(canon) - set(names)):
            parts.append(f"only in the profile: {_some([added + n for n in only_profile])}")
        raise InputError(_mismatch(meta, params, "; ".join(parts)))
    compiled, prefix, names, added, canon = exact
    by_canon = dict(zip(canon, theirs, strict=True))
    mapping = {r: by_canon[n] for r, n in zip(real, names, strict=True)}
    shape_of = {n: tuple(s) for n, s, _ in recorded}
    bad = [(r, p.shape) for r, p in zip(real, params, strict=True)
           if shape_of[mapping[r]] != p.shape]
    if bad:
        shown = "; ".join(f"{r} {list(s)} vs profile {list(shape_of[mapping[r]])}"
                          for r, s in bad[:3])
        raise InputError(_mismatch(meta, params, f"shapes differ for "
                                                 f"{_some([r for r, _ in bad])}: {shown}"))
    dtype_of = {n: d for n, _, d in recorded}
    note = _dtype_note([p.dtype for p in params], [dtype_of[mapping[r]] for r in real])
    return ModelMatch(mapping, prefix, added, compiled, note)


def _some(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


def _mismatch(meta: dict[str, Any], params: list[TrainableParam], what: str) -> str:
    return (f"profile was made for another model ({meta.get('workload') or 'unknown workload'},"
            f" fingerprint {meta.get('model_fingerprint')}; this model has "
            f"{fingerprint_of(params)}): {what}")
