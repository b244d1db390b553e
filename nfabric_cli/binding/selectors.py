"""Region selectors: which parameters a profile row applies to.

- a glob over parameter names (`fnmatch`, case-sensitive; `*` crosses dots): ``head.*``,
  ``*.bias``, ``blocks.*.attn.*``; a tied parameter matches through any of its names;
- ``type:NAME`` (NAME may be a glob): parameters owned by a module whose class, or one of its
  base classes, is called NAME, e.g. ``type:LayerNorm``, ``type:*Norm``;
- ``*`` matches every parameter (the usual default rule).
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from nfabric_cli.binding.fingerprint import TrainableParam
from nfabric_cli.errors import InputError

TYPE_PREFIX = "type:"


def check_selector(selector: str) -> str:
    """Return `selector` stripped, or raise InputError if it cannot match anything by syntax."""
    text = selector.strip()
    if not text:
        raise InputError("empty region selector")
    if text.startswith(TYPE_PREFIX) and not text[len(TYPE_PREFIX) :].strip():
        raise InputError(f"selector {selector!r}: expected a module type after 'type:'")
    return text


def selector_matches(selector: str, param: TrainableParam) -> bool:
    text = selector.strip()
    if text.startswith(TYPE_PREFIX):
        pattern = text[len(TYPE_PREFIX) :].strip()
        return any(fnmatchcase(name, pattern) for name in param.owner_type_names())
    return any(fnmatchcase(name, text) for name in param.aliases)


def select(selector: str, params: list[TrainableParam]) -> list[TrainableParam]:
    """The parameters `selector` matches, in model order."""
    check_selector(selector)
    return [p for p in params if selector_matches(selector, p)]
