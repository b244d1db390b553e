"""The reference profiles committed under `profiles/` are what `nfabric calibrate W` makes
today from the committed spec: they bind to the built-in workload's model and record the spec
and Hyperband shape they were searched with. A change to a workload's model or to
`calibrate/<W>.toml` fails here until the profile is recalibrated (the example CI job,
examples/ci/profile-check.yml, recalibrates and diffs against these files). The data
fingerprint is recorded but not held: `lm` trains on the interpreter's own `pydoc_data`
text, which changes with every CPython release."""

from __future__ import annotations

from pathlib import Path

import pytest

from nfabric_cli.binding import compile_profile, trainable_parameters
from nfabric_cli.calibration.spec import CalibrationSpec, load_spec
from nfabric_cli.calibration.strategy import pruner_label
from nfabric_cli.profile.store import read_profile, resolve_profile
from nfabric_cli.workloads.registry import BUILTINS, get_workload

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = sorted(p.name for p in (ROOT / "profiles").iterdir() if p.is_dir())


def test_every_builtin_workload_has_a_reference_profile():
    assert WORKLOADS == sorted(BUILTINS)


@pytest.mark.parametrize("name", WORKLOADS)
def test_latest_reference_profile_is_current(name: str) -> None:
    path = resolve_profile(ROOT / "profiles" / name)
    profile = read_profile(path)
    spec = load_spec(ROOT / "calibrate" / f"{name}.toml", name)
    wl = get_workload(name)
    meta, prov = profile.meta, profile.meta["provenance"]

    assert meta["workload"] == name
    assert meta["world_size"] == spec.world_size
    assert meta["target"]["tolerance"] == spec.tolerance
    assert meta["target"]["metric"] == wl.metric_name
    assert prov["source"] == "calibrate"
    # a key the spec gained after the profile was written counts at its default value
    defaults = CalibrationSpec(workload=name, regions=spec.regions).to_dict()
    recorded = {**{k: v for k, v in defaults.items() if k not in prov["spec"]}, **prov["spec"]}
    assert recorded == spec.to_dict(), f"{path.name} was calibrated from another spec"
    assert prov["pruner"] == pruner_label(spec)
    assert prov["sampler"] == spec.sampler and prov["seed"] == spec.seed
    assert len(prov["data_fingerprint"]) == 64
    assert not str(prov["git_revision"]).endswith("+dirty")
    assert abs(meta["target"]["reference"] - prov["reference_metric"]) == 0.0

    model = wl.build_model(spec.seed)
    bindings = compile_profile(profile, model)  # InputError if the fingerprint moved
    assert bindings.fingerprint == meta["model_fingerprint"]
    names = {p.name for p in trainable_parameters(model)}
    assert set(bindings.params) == names
