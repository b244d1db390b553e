"""Building the native codec kernels: `_kernels.c` compiled by the system C compiler, cached.

Built into the cache directory (`nfabric_cli/cache.py`, `NFABRIC_CACHE_DIR`), named
by a hash of source, flags and compiler, written atomically (ranks building at once each
rename a whole file). `routes/kernels.py` loads what this builds.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from nfabric_cli.cache import cache_dir

SOURCE = Path(__file__).with_name("_kernels.c")
CFLAGS = ("-O3", "-std=c99", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math")
#: Builds: baseline (SSE2 on x86-64) runs anywhere; avx2 where the CPU has it; portable is the
#: plain-C path other architectures compile (chosen only on request: tests compare all three).
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "baseline": (), "avx2": ("-mavx2",), "portable": ("-U__SSE2__", "-U__AVX2__"),
}


def _compiler() -> list[str] | None:
    cc = os.environ.get("CC")
    if cc:
        return shlex.split(cc)
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return [found] if found else None


def build(isa: str = "baseline", directory: Path | None = None) -> Path:
    """Compile `_kernels.c` for `isa` (once per source/flags/compiler hash); the library path.

    Raises OSError or subprocess.SubprocessError when it cannot; `native()` turns that into
    the torch fallback."""
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")
    flags = [*CFLAGS, *ISA_FLAGS[isa]]
    key = hashlib.sha256(
        b"\0".join([SOURCE.read_bytes(), " ".join(flags).encode(), " ".join(cc).encode(),
                    platform.machine().encode()])
    ).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"routes_kernels-{isa}-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        subprocess.run([*cc, *flags, "-o", tmp, str(SOURCE), "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)  # atomic: ranks building at once each rename a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for old in directory.glob(f"routes_kernels-{isa}-*.so"):  # builds of older sources
        if old != target:
            old.unlink(missing_ok=True)  # a process that loaded it keeps its mapping
    return target
