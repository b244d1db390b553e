"""Which code trained a study's results: a fingerprint of the package's sources.

A resumed study reuses what it holds (its trials, the FP32 reference, confirmation cells), and
a profile's record is only as true as the runs behind it: `transformer.v6` recorded cells that
today's code, and the revision it names, train to other metrics (docs/calibration.md). Every
result a study stores now carries this fingerprint; a resumed study names the results that
other code trained, and the profile's provenance counts them.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

_PACKAGE = Path(__file__).resolve().parents[1]
#: The user attribute that holds it, on trials and in the study's stored runs (the FP32
#: references, confirmation cells: every stored dict with a "metric").
KEY = "code"


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """sha256 of the package's Python and C sources (paths and bytes), 16 hex digits: any
    change to the package counts, since which change moves the numerics is not known."""
    digest = hashlib.sha256()
    for path in sorted(p for p in _PACKAGE.rglob("*") if p.suffix in (".py", ".c")):
        digest.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def foreign_results(study: optuna.Study) -> list[str]:
    """The study's stored results that other code trained (or code from before fingerprints):
    "trial N" per completed trial, the job name per stored run."""
    here = code_fingerprint()
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    out = [f"trial {t.number}" for t in done
           if "metric" in t.user_attrs and t.user_attrs.get(KEY) != here]
    attrs: dict[str, Any] = study.user_attrs
    out += [job for job, value in sorted(attrs.items())
            if isinstance(value, dict) and "metric" in value and value.get(KEY) != here]
    return out
