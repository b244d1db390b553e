"""Where nfabric caches what it builds (native kernels, rendered glyph data): one directory.

`NFABRIC_CACHE_DIR` if set, else `$XDG_CACHE_HOME/nfabric`, else `~/.cache/nfabric`.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "NFABRIC_CACHE_DIR"


def cache_dir() -> Path:
    """The cache directory (not created here: writers create it when they first write)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nfabric"
