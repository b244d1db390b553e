"""Lightning, the HF Trainer and Accelerate with nfabric: the real frameworks, 2 gloo ranks,
gradient accumulation, a checkpoint and a resumed run, and the single-process mistake."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.integrations.helpers import check_clean, failure_line, ranks_of, run_example

REPO = Path(__file__).resolve().parents[2]
STEPS, MORE, ACCUMULATE = 4, 6, 2
# per optimizer step and rank on this example's Net (head 260 elements on fp32, body 5184 on
# 1-bit sign with error feedback, 2 ranks): what the hook reports it moved. At 2 ranks sign
# all-gathers its codes: 648 bytes of bits and 6 scales, sent and received.
SIGN_BYTES, FP32_BYTES = 2 * (648 + 6 * 4), 2080


def _check_run(docs: list[dict], steps: int, total: int) -> None:
    for doc in docs:
        assert doc["fabric_step"] == steps and doc["total_steps"] == total
        assert doc["bytes"]["sign/sharded+ef"] == SIGN_BYTES * steps  # compressed, every step
        assert doc["bytes"]["fp32"] == FP32_BYTES * steps
        assert doc["events"] == []
    assert docs[0]["bytes"] == docs[1]["bytes"]


def _check_residuals(first: list[dict], resumed: list[dict]) -> None:
    """Each rank resumed with the error-feedback residuals it saved, its own (they differ by
    rank: a rank given another's would pass a count check)."""
    assert [d["loaded"] for d in resumed] == [d["saved"] for d in first]
    assert first[0]["saved"] != first[1]["saved"]


@pytest.mark.slow
def test_lightning_strategy_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "lt"
    first = run_example("lightning_train.py", "--out", str(out), "--steps", str(STEPS),
                        "--accumulate", str(ACCUMULATE))
    check_clean(first)
    docs = ranks_of(out)
    _check_run(docs, STEPS, STEPS)
    assert [d["nonfinite"] for d in docs] == ["zero", "zero"]  # no loss scaler at 32-true
    assert all(d["global_step"] == STEPS and d["micro_batches"] == STEPS * ACCUMULATE
               for d in docs)  # one fabric step per optimizer step, not per batch
    import torch

    ckpt = torch.load(out / "ckpt" / "last.ckpt", weights_only=True)
    # rank 0 wrote the file, every rank's residuals gathered onto it (and onto it only)
    assert ckpt["nfabric"]["step"] == STEPS and sorted(ckpt["nfabric"]["ranks"]) == [0, 1]
    # after fit the state is closed, and still reads as it did at the end of training
    after = [json.loads((out / f"rank{r}.after0.json").read_text()) for r in (0, 1)]
    assert after == [{"closed": True, "fabric_step": STEPS, "bytes": d["bytes"], "residuals": 0}
                     for d in docs]
    logged = (out / "logs" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert "nfabric/traffic_fraction" in logged and "nfabric/fallbacks" in logged
    resumed = run_example("lightning_train.py", "--out", str(out), "--steps", str(MORE),
                          "--accumulate", str(ACCUMULATE), "--resume",
                          str(out / "ckpt" / "last.ckpt"), "--then", str(MORE + 2))
    check_clean(resumed)
    # the counters went on from the checkpoint; then a second fit on the same Trainer from
    # "last" went on again (its state was once restored into the first fit's closed one, and
    # a fresh one attached at step 0: 2 steps where 8 are due), the first fit's state still
    # readable between the two
    fit0 = [json.loads((out / f"rank{r}.fit0.json").read_text()) for r in (0, 1)]
    _check_run(fit0, MORE, MORE)
    _check_residuals(docs, fit0)
    _check_run(ranks_of(out), MORE + 2, MORE + 2)
    assert [json.loads((out / f"rank{r}.after1.json").read_text())["fabric_step"]
            for r in (0, 1)] == [MORE + 2, MORE + 2]


@pytest.mark.slow
def test_lightning_fp16_mixed_precision_passes_overflows_to_its_scaler(tmp_path: Path) -> None:
    """fp16 mixed precision runs a GradScaler, which must see an overflowing step to lower its
    scale: the strategy attaches with nonfinite="pass" there (not under 32-true, above). On a
    GPU `precision="16-mixed"` sets it up; on the CPU Lightning makes that bf16, so the example
    hands Trainer the same plugin with a CPU GradScaler."""
    out = tmp_path / "lt16"
    check_clean(run_example("lightning_train.py", "--out", str(out), "--steps", "2",
                            "--precision", "fp16-scaler"))
    assert [d["nonfinite"] for d in ranks_of(out)] == ["pass", "pass"]


@pytest.mark.slow
def test_hf_trainer_callback_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    args = ["--out", str(out), "--accumulate", str(ACCUMULATE)]
    first = run_example("hf_trainer_train.py", *args, "--steps", str(STEPS), torchrun=True)
    check_clean(first)
    docs = ranks_of(out)
    _check_run(docs, STEPS, STEPS)
    # train() closed the state and freed its residuals (evaluate/predict hold none)
    assert [(d["closed"], d["residuals"]) for d in docs] == [(True, 0), (True, 0)]
    assert all(d["global_step"] == STEPS for d in docs)
    assert docs[0]["logged"] == ["nfabric/traffic_fraction", "nfabric/bytes",
                                 "nfabric/fallbacks", "nfabric/skipped_steps"]
    import torch

    for rank in (0, 1):  # each rank wrote its own state, beside the Trainer's rng_state_<r>
        saved = torch.load(out / f"checkpoint-{STEPS}" / f"nfabric_state_{rank}.pt",
                           weights_only=True)
        assert saved["step"] == STEPS and list(saved["ranks"]) == [rank]
    resumed = run_example("hf_trainer_train.py", *args, "--steps", str(MORE), "--resume",
                          torchrun=True)
    check_clean(resumed)
    _check_run(ranks_of(out), MORE, MORE)
    _check_residuals(docs, ranks_of(out))


@pytest.mark.slow
def test_a_second_hf_train_on_one_trainer_is_a_run_of_its_own(tmp_path: Path) -> None:
    """The Trainer keeps its DDP wrapper, and DDP its first hook: the second train() attaches
    a new state, which the first one's closed state hands its buckets to."""
    out = tmp_path / "hf2"
    run = run_example("hf_trainer_train.py", "--out", str(out), "--accumulate",
                      str(ACCUMULATE), "--steps", str(STEPS), "--twice", torchrun=True)
    check_clean(run)
    for d in ranks_of(out):
        assert d["new_state"] and d["first_fabric_step"] == STEPS
        assert d["fabric_step"] == d["global_step"] == STEPS and d["closed"]
        assert sum(d["bytes"].values()) > 0


@pytest.mark.slow
def test_accelerate_helper_trains_checkpoints_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "acc"
    out.mkdir()
    args = ["--out", str(out), "--steps", str(STEPS), "--accumulate", str(ACCUMULATE)]
    first = run_example("accelerate_train.py", *args, torchrun=True)
    check_clean(first)
    # the example loads its checkpoint again after close (to evaluate it): said once, rank 0
    log = first.stdout + first.stderr
    assert log.count(f"nfabric: Accelerate loaded {out / 'state'} with the fabric's state "
                     "closed: the fabric's part was not restored") == 1, log[-4000:]
    docs = ranks_of(out)
    _check_run(docs, STEPS, 2 * STEPS)
    assert all(d["optimizer_steps"] == STEPS for d in docs)
    assert sorted(p.name for p in (out / "state").glob("nfabric_state_*")) == [
        "nfabric_state_0.pt", "nfabric_state_1.pt"]  # one per rank, beside random_states_<r>
    check_clean(run_example("accelerate_train.py", *args, "--resume", torchrun=True))
    _check_run(ranks_of(out), 2 * STEPS, 2 * STEPS)
    _check_residuals(docs, ranks_of(out))


@pytest.mark.slow
def test_a_single_process_is_refused_in_one_line(tmp_path: Path) -> None:
    # three independent launches, mostly imports: run side by side
    for name in ("acc", "lt", "hf"):
        (tmp_path / name).mkdir()
    with ThreadPoolExecutor(3) as pool:
        acc, lt, hf = pool.map(lambda args: run_example(*args), [
            ("accelerate_train.py", "--out", str(tmp_path / "acc"), "--steps", "1"),
            ("lightning_train.py", "--out", str(tmp_path / "lt"), "--steps", "1", "--devices", "1"),
            ("hf_trainer_train.py", "--out", str(tmp_path / "hf"), "--steps", "1")])
    line = failure_line(acc, "InputError: nfabric:")
    assert "Accelerate started a single process" in line and "torchrun" in line
    line = failure_line(lt, "InputError: nfabric:")
    assert "Lightning started a single process" in line and "start 2 or more" in line
    line = failure_line(hf, "InputError: nfabric:")
    assert "the HF Trainer did not wrap the model in DistributedDataParallel" in line
    assert "torchrun --nproc_per_node N" in line


def test_a_framework_loss_scaler_makes_nonfinite_pass_unless_the_user_said() -> None:
    from nfabric_cli.integrations.common import AttachOptions

    scaler = object()  # whatever the framework holds: only its presence counts
    p = str(REPO / "profiles" / "vision")
    assert AttachOptions(p, None, {"seed": 1}).options(scaler) == {"seed": 1, "nonfinite": "pass"}
    assert AttachOptions(p, None, {"nonfinite": "zero"}).options(scaler) == {"nonfinite": "zero"}
    assert AttachOptions(p, None, {"seed": 1}).options(None) == {"seed": 1}


@pytest.mark.parametrize(
    ("source", "total_steps", "extra", "message"),
    [("vision", 0, {}, "total steps must be a whole number >= 1, got 0"),
     ("vision", -5, {}, "total steps must be a whole number >= 1, got -5"),
     ("vision", None, {"total_steps": 3}, "nfabric: total_steps in the attach options: pass "
                                          "total_steps= (and the profile) to the adapter itself"),
     ("vision", None, {"gates": "x"}, "nfabric: unknown attach option(s) gates (choose from "
                                      "substrate, monitor, gate, seed,"),
     ("vision", None, {"gate": "measured"}, "gate: True, False or 'measure', got 'measured'"),
     ("vision", None, {"monitor": "no"}, "monitor: True or False, got 'no'"),
     ("nope", None, {}, "no such file or directory")],
)  # fmt: skip
def test_an_adapters_own_options_are_checked_where_they_are_given(
        source: str, total_steps: int | None, extra: dict, message: str) -> None:
    """Checked when the adapter is built (Lightning builds its strategy before the ranks start),
    not ignored (a total_steps of 0 once meant the framework's count) or found later."""
    from nfabric_cli.errors import InputError
    from nfabric_cli.integrations.common import AttachOptions

    with pytest.raises(InputError) as err:
        AttachOptions(str(REPO / "profiles" / source), total_steps, extra)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_hf_resume_from_checkpoint_true_with_none_saved_is_the_trainers_own_error(
        tmp_path: Path) -> None:
    """`train(resume_from_checkpoint=True)` in an output folder with no checkpoint: the Trainer
    refuses it; through `attach_trainer` the lookup's None was passed on, and the run started
    from scratch as if resumed (here, one process, it then met attach's refusal instead)."""
    from nfabric_cli.integrations.hf_trainer import attach_trainer

    trainer = _one_process_trainer(tmp_path)
    attach_trainer(trainer, "profiles/vision")
    with pytest.raises(ValueError, match="No valid checkpoint found"):
        trainer.train(resume_from_checkpoint=True)


@pytest.mark.slow
def test_hf_checkpoints_of_a_hyperparameter_search_trial_go_to_its_run_folder(
        tmp_path: Path) -> None:
    """Under `trainer.hyperparameter_search` the Trainer saves a trial's checkpoints in
    `output_dir/run-<trial>`; the fabric state went to `output_dir/checkpoint-N`, a folder the
    Trainer never resumes from (and the next trial overwrote)."""
    from types import SimpleNamespace

    from transformers.trainer_utils import HPSearchBackend

    from nfabric_cli.integrations.hf_trainer import attach_trainer

    trainer = _one_process_trainer(tmp_path)
    callback = attach_trainer(trainer, "profiles/vision")
    assert callback._run_dir(trainer.args) == str(tmp_path)
    trainer.hp_search_backend, trainer._trial = HPSearchBackend.OPTUNA, SimpleNamespace(number=3)
    assert callback._run_dir(trainer.args) == str(tmp_path / "run-3")


def _one_process_trainer(out: Path):  # noqa: ANN202 - a transformers.Trainer
    import torch
    from transformers import Trainer, TrainingArguments

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Linear(2, 1)

        def forward(self, x: torch.Tensor) -> dict:
            return {"loss": self.w(x).pow(2).mean()}

    args = TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], max_steps=1)
    return Trainer(model=Net(), args=args, train_dataset=[{"x": torch.ones(2)}] * 4)


def test_sync_each_batch_with_accumulation_is_refused_in_one_line() -> None:
    """Accelerate's `sync_each_batch` (the HF Trainer's through its accelerator) makes DDP
    reduce every micro-batch: the hook would count micro-batches as steps and compress the
    already-reduced part of `.grad` again. Refused before attaching; alone (no accumulation)
    it changes nothing and passes."""
    from types import SimpleNamespace

    from nfabric_cli.errors import InputError
    from nfabric_cli.integrations.accelerate import attach_accelerate
    from nfabric_cli.integrations.common import require_one_sync_per_step

    def accelerator(sync: bool, steps: int) -> SimpleNamespace:
        return SimpleNamespace(num_processes=2, gradient_accumulation_steps=steps,
                               gradient_state=SimpleNamespace(plugin_kwargs={"sync_each_batch": sync}))

    with pytest.raises(InputError, match=r"^nfabric: Accelerate accumulates 2 micro-batches "
                                         r"with sync_each_batch=True.*drop sync_each_batch$"):
        attach_accelerate(accelerator(True, 2), object(), "profiles/vision", 10)
    with pytest.raises(InputError, match="the HF Trainer accumulates 4 micro-batches"):
        require_one_sync_per_step(accelerator(True, 4), 4, "the HF Trainer")
    for ok in (accelerator(True, 1), accelerator(False, 2), None):
        require_one_sync_per_step(ok, 2 if ok is None else ok.gradient_accumulation_steps, "x")
    with pytest.raises(InputError, match="did not wrap the model"):  # past the check: attach's
        attach_accelerate(accelerator(False, 2), object(), "profiles/vision", 10)


def test_attaching_after_accelerates_load_state_warns() -> None:
    """`load_state` runs the load pre-hooks registered by then and restores
    `accelerator.step`: attached after it, the fabric starts afresh, which attach says."""
    from types import SimpleNamespace

    from nfabric_cli.errors import InputError
    from nfabric_cli.integrations.accelerate import attach_accelerate

    restored = SimpleNamespace(num_processes=2, gradient_accumulation_steps=1, step=8,
                               gradient_state=SimpleNamespace(plugin_kwargs={}))
    with pytest.warns(UserWarning, match=r"^nfabric: accelerator.step is 8 at attach: load_state "
                                         r".*attach before accelerator.load_state to resume it$"):
        with pytest.raises(InputError, match="did not wrap the model"):  # (then attach's own)
            attach_accelerate(restored, object(), "profiles/vision", 10)
