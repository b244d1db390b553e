"""Plugin loading (`MODULE:FN` from the current directory) and its one-line errors."""

from __future__ import annotations

import itertools
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nfabric_cli.errors import InputError
from nfabric_cli.workloads.base import held_out_metric
from nfabric_cli.workloads.registry import describe, get_workload, list_workloads, load_model
from tests.workloads.helpers import train

_ids = itertools.count()

GOOD = """
import torch
from torch import nn
from nfabric_cli.workloads.registry import get_workload

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)
    def forward(self, x):
        return self.head(torch.relu(self.body(x)))

def workload(data_dir=None):
    w = get_workload("vision")
    w.name = "from-plugin:" + str(data_dir)
    return w

def model():
    return Tiny()

def not_a_workload():
    return 42

def half_workload():
    class Half:
        name = "half"
        metric_name = "accuracy"
        def loss(self, model, batch):
            return 0.0
    return Half()

def bad_types():
    w = get_workload("transformer")
    w.batch_size = "32"
    return w

def boom():
    raise RuntimeError("disk on fire")

NOT_CALLABLE = 3
"""


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write a module into tmp_path, chdir there (sys.path restored after); return its name."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])

    def write(source: str = GOOD) -> str:
        name = f"nfabric_test_plugin_{next(_ids)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    return write


def test_builtin_and_unknown_names() -> None:
    assert get_workload("lm").name == "lm"
    with pytest.raises(InputError) as err:
        get_workload("resnet")
    assert str(err.value) == (
        "unknown workload 'resnet' (built-ins: vision, transformer, lm, glyphs; or MODULE:FN for a plugin)"
    )
    with pytest.raises(InputError, match="reads no --data-dir"):
        get_workload("transformer", "/tmp")


def test_plugin_workload_from_current_directory(plugin) -> None:
    mod = plugin()
    w = get_workload(f"{mod}:workload")  # found only because the cwd is put on sys.path
    assert w.name == "from-plugin:None"
    assert get_workload(f"{mod}:workload", data_dir="/data").name == "from-plugin:/data"
    row = describe(w)
    assert row["name"] == "from-plugin:None" and row["params"] == 77290


def test_plugin_model(plugin) -> None:
    mod = plugin()
    model = load_model(f"{mod}:model")
    assert [n for n, _ in model.named_parameters()] == [
        "body.weight",
        "body.bias",
        "head.weight",
        "head.bias",
    ]
    via_workload = load_model(f"{mod}:workload")  # a workload works too: its build_model(0)
    assert torch.equal(via_workload.head.weight, get_workload("vision").build_model(0).head.weight)
    assert sum(p.numel() for p in load_model("lm").parameters()) == 167360


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("nosuch", "module '{mod}' has no attribute 'nosuch'"),
        ("NOT_CALLABLE", "{mod}:NOT_CALLABLE is not callable (a int object)"),
        ("not_a_workload", "{mod}:not_a_workload() returned int, not a workload: missing name,"),
        (
            "half_workload",
            "{mod}:half_workload() returned Half, not a workload: missing higher_is_better, "
            "default_steps, batch_size, head_selector, build_model, make_optimizer, train_batch, "
            "shard_indices, evaluate, data_fingerprint",
        ),
        ("bad_types", "workload {mod}:bad_types: batch_size must be int, got str"),
        ("boom", "{mod}:boom() raised RuntimeError: disk on fire"),
    ],
)
def test_plugin_errors(plugin, fn: str, message: str) -> None:
    mod = plugin()
    with pytest.raises(InputError) as err:
        get_workload(f"{mod}:{fn}")
    assert str(err.value).startswith(message.format(mod=mod))
    assert "\n" not in str(err.value)


def test_a_plugin_named_by_its_file(plugin, tmp_path: Path, monkeypatch) -> None:
    """`path/to/mywl.py:FN`, what a new user types first (was: "cannot import module
    'mywl.py'"), from another directory too."""
    mod = plugin()
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)
    assert get_workload(f"../{mod}.py:workload").name == get_workload(f"{mod}:workload").name
    assert get_workload(f"{tmp_path}/{mod}.py:workload").name == "from-plugin:None"
    with pytest.raises(InputError, match=r"^bad plugin spec 'nope\.py:workload': no file nope\.py$"):
        get_workload("nope.py:workload")
    (other / "json.py").write_text("def workload():\n    return None\n")  # a taken name
    with pytest.raises(InputError, match=r"a module named 'json' is already imported from .*; "
                                         "rename the file$"):
        get_workload("json.py:workload")


def test_import_errors(plugin) -> None:
    with pytest.raises(InputError, match=r"cannot import module 'no_such_mod_xyz' \(not found"):
        get_workload("no_such_mod_xyz:workload")
    broken = plugin("def workload(:\n    pass\n")
    with pytest.raises(InputError, match=f"module '{broken}' failed to import: SyntaxError"):
        get_workload(f"{broken}:workload")
    needs = plugin("import no_such_dependency_xyz\n")
    with pytest.raises(
        InputError,
        match=f"module '{needs}' failed to import: ModuleNotFoundError: No module named "
        "'no_such_dependency_xyz'",
    ):
        get_workload(f"{needs}:workload")
    for spec in ("mod:", ":fn"):
        with pytest.raises(InputError, match="expected MODULE:FN"):
            get_workload(spec)


def test_model_errors_and_data_dir_refused(plugin) -> None:
    mod = plugin()
    with pytest.raises(
        InputError, match=f"{mod}:not_a_workload\\(\\) returned int, expected a torch.nn.Module"
    ):
        load_model(f"{mod}:not_a_workload")
    no_dir = plugin("def workload():\n    return None\n")
    with pytest.raises(
        InputError, match=f"--data-dir given but {no_dir}:workload\\(\\) takes no data_dir"
    ):
        get_workload(f"{no_dir}:workload", data_dir="/data")
    with pytest.raises(InputError, match="unknown workload 'nope'"):
        load_model("nope")


def test_list_workloads_rows() -> None:
    rows = list_workloads()
    assert [r["name"] for r in rows] == ["vision", "transformer", "lm", "glyphs"]
    assert [(r["metric"], r["higher_is_better"]) for r in rows] == [
        ("accuracy", True),
        ("accuracy", True),
        ("val_loss", False),
        ("accuracy", True),
    ]
    assert [(r["default_steps"], r["batch_size"], r["params"]) for r in rows] == [
        (200, 32, 77290),
        (300, 32, 101962),
        (400, 16, 167360),
        (1200, 32, 1033168),
    ]
    assert all(r["head_selector"] == "head.*" and r["description"] for r in rows)


def test_example_plugin_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented example file is a valid workload that trains to a good accuracy."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the repository root
    w = get_workload("examples.plugin_workload:workload")
    assert (
        w.evaluate(train(w, w.default_steps, 2, 0)) > 0.93
    )  # measured 0.965 (114 held-out samples)
    assert [n for n, _ in load_model("examples.plugin_workload:model").named_parameters()][-2:] == [
        "head.weight",
        "head.bias",
    ]


class _BareEvaluate:
    """A plugin's evaluate that sets no mode and takes no care: dropout stays as it finds it."""

    def evaluate(self, model: torch.nn.Module) -> float:
        self.saw_training = model.training
        return float(model(torch.ones(64, 8)).sum())


def test_a_held_out_metric_is_taken_in_eval_mode_without_touching_the_random_state() -> None:
    """The protocol promises evaluate an eval-mode model: a plugin that does not set it itself
    measured random dropout masks, which validate and the simulator drew differently."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
    wl = _BareEvaluate()
    state = torch.get_rng_state()
    first, second = held_out_metric(wl, model), held_out_metric(wl, model)
    with torch.no_grad():
        assert first == second == float(model.eval()(torch.ones(64, 8)).sum())
    model.train()
    assert held_out_metric(wl, model) == first and wl.saw_training is False
    assert model.training  # the caller's mode is restored
    assert torch.equal(torch.get_rng_state(), state)
    with torch.no_grad():  # the premise: training draws masks
        assert float(model(torch.ones(64, 8)).sum()) != first
