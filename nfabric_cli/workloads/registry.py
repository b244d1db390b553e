"""Find a workload or a model by name: the built-ins, or a plugin given as `MODULE:FN`.

`MODULE:FN` imports MODULE (the current directory is on the import path) and calls FN();
for `get_workload` FN returns a workload object (see `workloads/base.py`), for `load_model`
an `nn.Module`. Every failure is an `InputError` with one line that says what to fix.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from nfabric_cli.errors import InputError
from nfabric_cli.workloads.base import Workload
from nfabric_cli.workloads.common import count_params


def _vision(data_dir: str | None) -> Workload:
    from nfabric_cli.workloads.vision import VisionWorkload

    return VisionWorkload(data_dir)


def _transformer(data_dir: str | None) -> Workload:
    if data_dir is not None:
        raise InputError("workload 'transformer' reads no --data-dir (it trains on the digits)")
    from nfabric_cli.workloads.transformer import TransformerWorkload

    return TransformerWorkload()


def _glyphs(data_dir: str | None) -> Workload:
    if data_dir is not None:
        raise InputError("workload 'glyphs' reads no --data-dir (it renders bundled fonts)")
    from nfabric_cli.workloads.glyphs import GlyphsWorkload

    return GlyphsWorkload()


def _lm(data_dir: str | None) -> Workload:
    from nfabric_cli.workloads.lm import LMWorkload

    return LMWorkload(data_dir)


#: Built-in workloads by name; each factory takes the optional --data-dir.
BUILTINS: dict[str, Callable[[str | None], Workload]] = {
    "vision": _vision,
    "transformer": _transformer,
    "lm": _lm,
    "glyphs": _glyphs,
}

_SCALARS: tuple[tuple[str, type], ...] = (
    ("name", str),
    ("metric_name", str),
    ("higher_is_better", bool),
    ("default_steps", int),
    ("batch_size", int),
    ("head_selector", str),
)
_METHODS = (
    "build_model",
    "make_optimizer",
    "train_batch",
    "shard_indices",
    "loss",
    "evaluate",
    "data_fingerprint",
)


def get_workload(spec: str, data_dir: str | None = None) -> Workload:
    """A built-in workload (`vision`, `transformer`, `lm`, `glyphs`) or a plugin `MODULE:FN`.

    A plugin FN is called with `data_dir=...` when `data_dir` is given (and must accept it).
    """
    if ":" not in spec:
        factory = BUILTINS.get(spec)
        if factory is None:
            raise InputError(
                f"unknown workload {spec!r} (built-ins: {', '.join(BUILTINS)}; "
                "or MODULE:FN for a plugin)"
            )
        return factory(data_dir)
    fn = _import_callable(spec)
    if data_dir is not None and not _accepts(fn, "data_dir"):
        raise InputError(f"--data-dir given but {spec}() takes no data_dir argument")
    obj = _call(fn, spec, {} if data_dir is None else {"data_dir": data_dir})
    check_workload(obj, spec)
    return obj


def load_model(spec: str) -> nn.Module:
    """A model: `MODULE:FN` returning an `nn.Module` (or a workload: its `build_model(0)`),
    or a built-in workload name (its `build_model(0)`)."""
    if ":" not in spec:
        return get_workload(spec).build_model(0)
    obj = _call(_import_callable(spec), spec, {})
    if isinstance(obj, nn.Module):
        return obj
    if isinstance(obj, Workload):
        check_workload(obj, spec)
        return obj.build_model(0)
    raise InputError(f"{spec}() returned {type(obj).__name__}, expected a torch.nn.Module")


def check_workload(obj: Any, spec: str) -> None:
    """Raise `InputError` naming what `obj` lacks to be a workload (attributes, types)."""
    missing = [n for n, _ in _SCALARS if not hasattr(obj, n)]
    missing += [n for n in _METHODS if not callable(getattr(obj, n, None))]
    if missing:
        raise InputError(
            f"{spec}() returned {type(obj).__name__}, not a workload: "
            f"missing {', '.join(missing)} (see nfabric_cli/workloads/base.py)"
        )
    for attr, kind in _SCALARS:
        value = getattr(obj, attr)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InputError(
                f"workload {spec}: {attr} must be {kind.__name__}, got {type(value).__name__}"
            )
    for attr in ("default_steps", "batch_size"):
        if getattr(obj, attr) < 1:
            raise InputError(f"workload {spec}: {attr} must be >= 1, got {getattr(obj, attr)}")


def describe(workload: Workload, params: int | None = None) -> dict[str, Any]:
    """One row of `nfabric workloads`: stable keys, plain values."""
    if params is None:
        params = count_params(workload.build_model(0))
    return {
        "name": workload.name,
        "metric": workload.metric_name,
        "higher_is_better": workload.higher_is_better,
        "default_steps": workload.default_steps,
        "batch_size": workload.batch_size,
        "params": params,
        "head_selector": workload.head_selector,
        "description": getattr(workload, "description", "") or type(workload).__doc__ or "",
        "data_fingerprint": workload.data_fingerprint(),
    }


def list_workloads() -> list[dict[str, Any]]:
    """The built-in workloads, described (`describe`), in registry order."""
    return [describe(get_workload(name)) for name in BUILTINS]


def _import_callable(spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InputError(f"bad plugin spec {spec!r}: expected MODULE:FN, e.g. my_workload:build")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)  # the current directory is on the import path, as promised
    path = Path(module_name)
    if path.suffix == ".py":  # a file (`path/to/mywl.py:build`): its folder, then its name
        if not path.is_file():
            raise InputError(f"bad plugin spec {spec!r}: no file {module_name}")
        folder, module_name = str(path.resolve().parent), path.stem
        if folder not in sys.path:
            sys.path.insert(0, folder)
        known = sys.modules.get(module_name)
        where = getattr(known, "__file__", None)
        if known is not None and (where is None or Path(where).resolve() != path.resolve()):
            raise InputError(f"bad plugin spec {spec!r}: a module named {module_name!r} is "
                             f"already imported from {where or 'elsewhere'}; rename the file")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise InputError(
                f"cannot import module {module_name!r} (not found from {cwd} or sys.path)"
            ) from None
        raise InputError(f"module {module_name!r} failed to import: {_one_line(exc)}") from None
    except Exception as exc:  # a plugin's own error at import time is still the user's input
        raise InputError(f"module {module_name!r} failed to import: {_one_line(exc)}") from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise InputError(f"module {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise InputError(f"{spec} is not callable (a {type(target).__name__} object)")
    return target


def _call(fn: Callable[..., Any], spec: str, kwargs: dict[str, Any]) -> Any:
    try:
        return fn(**kwargs)
    except InputError:
        raise
    except Exception as exc:
        raise InputError(f"{spec}() raised {_one_line(exc)}") from None


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())
