"""nfabric: safe, measurable low-bit gradient communication for PyTorch DDP.

Data flows one way: spec -> profile -> bindings -> runtime -> report. The public surface is
the nouns below; everything else is internal. Two ways to put a profile on a DDP model::

    state = nfabric_cli.attach(ddp, "profiles/vision", total_steps=1000)

    state = nfabric_cli.FabricState.create(ddp, "profiles/vision", total_steps=1000)
    ddp.register_comm_hook(state, nfabric_cli.fabric_hook)      # PyTorch's own idiom

Names are imported on first use (so `import nfabric_cli`, and the CLI's start-up, do not
import torch.distributed), yet `dir()` and type checkers see them all.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_SOURCES = {
    "attach": "nfabric_cli.runtime.attach",
    "FabricState": "nfabric_cli.runtime.state",
    "fabric_hook": "nfabric_cli.runtime.hook",
    "compile_profile": "nfabric_cli.binding.compile",
    "Bindings": "nfabric_cli.binding.bindings",
    "read_profile": "nfabric_cli.profile.store",
    "write_profile": "nfabric_cli.profile.store",
    "OperatingProfile": "nfabric_cli.profile.operating",
    "Substrate": "nfabric_cli.substrate.model",
    "InputError": "nfabric_cli.errors",
    "CheckFailed": "nfabric_cli.errors",
    "exit_rank": "nfabric_cli.ranks.exit",
    "AccumulationWarning": "nfabric_cli.runtime.accumulation",
}

__all__ = [
    "__version__", "attach", "FabricState", "fabric_hook", "compile_profile", "Bindings",
    "read_profile", "write_profile", "OperatingProfile", "Substrate", "InputError",
    "CheckFailed", "exit_rank", "AccumulationWarning",
]
assert __all__[1:] == list(_SOURCES)  # one list of names, said twice for type checkers

if TYPE_CHECKING:
    from nfabric_cli.binding.bindings import Bindings
    from nfabric_cli.binding.compile import compile_profile
    from nfabric_cli.errors import CheckFailed, InputError
    from nfabric_cli.profile.operating import OperatingProfile
    from nfabric_cli.profile.store import read_profile, write_profile
    from nfabric_cli.ranks.exit import exit_rank
    from nfabric_cli.runtime.accumulation import AccumulationWarning
    from nfabric_cli.runtime.attach import attach
    from nfabric_cli.runtime.hook import fabric_hook
    from nfabric_cli.runtime.state import FabricState
    from nfabric_cli.substrate.model import Substrate


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'nfabric_cli' has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
