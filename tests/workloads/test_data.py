"""Data sources: the digits split, the pydoc corpus and its windows, the CIFAR binary reader."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from nfabric_cli.errors import InputError
from nfabric_cli.workloads.images import load_cifar, load_digits_data
from nfabric_cli.workloads.lm import LMWorkload, load_corpus, pydoc_text
from nfabric_cli.workloads.registry import get_workload


def test_digits_split_is_fixed_and_stratified() -> None:
    data = load_digits_data()
    assert data.x_train.shape == (1437, 1, 8, 8) and data.x_test.shape == (360, 1, 8, 8)
    # Stratified: each class keeps its share (1797 images, 360 held out: 35-37 per class).
    assert torch.bincount(data.y_test).tolist() == [36, 36, 35, 37, 36, 37, 36, 36, 35, 36]
    assert abs(float(data.x_train.mean())) < 1e-5 and abs(float(data.x_train.std()) - 1) < 1e-3
    assert data.fingerprint == get_workload("transformer").data_fingerprint()


def test_lm_corpus_fingerprint_split_and_windows() -> None:
    text = pydoc_text()
    corpus = load_corpus()
    assert corpus.fingerprint == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert len(corpus.train) + len(corpus.val) == len(text)
    assert len(corpus.train) == int(0.9 * len(text))
    assert (
        "".join(corpus.vocab[i] for i in corpus.val[:50].tolist()) == text[len(corpus.train) :][:50]
    )
    # Unigram cross-entropy: well below uniform over the vocabulary, as English is.
    assert 2.5 < corpus.unigram_loss() < math.log(len(corpus.vocab))
    w = LMWorkload()
    inputs, targets = w.train_batch(3, 1, 2, 0)
    assert inputs.shape == targets.shape == (w.batch_size, w.context)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # next-character targets
    # Windows sit on a grid of `context` characters, shifted by 29 per epoch.
    idx = w.batch_indices(3, 1, 2, 0)
    assert torch.equal(inputs[0], corpus.train[idx[0] * w.context : (idx[0] + 1) * w.context])
    epoch1 = w._gather(idx[:1], 1)[0][0]
    assert torch.equal(epoch1, corpus.train[idx[0] * w.context + 29 :][: w.context])
    last = w._gather(np.array([w._train_size() - 1]), 63)  # largest index, largest shift
    assert last[1].shape == (1, w.context)


def test_lm_reads_input_txt(tmp_path) -> None:
    text = "the quick brown fox jumps over the lazy dog. " * 200
    (tmp_path / "input.txt").write_text(text, encoding="utf-8")
    w = get_workload("lm", str(tmp_path))
    assert w.corpus.vocab == "".join(sorted(set(text)))
    assert w.data_fingerprint() == hashlib.sha256(text.encode()).hexdigest()
    with pytest.raises(InputError, match="has no input.txt"):
        get_workload("lm", str(tmp_path / "missing"))
    (tmp_path / "utf16").mkdir()
    (tmp_path / "utf16" / "input.txt").write_text(text, encoding="utf-16")
    with pytest.raises(InputError, match=r"utf16/input.txt is not UTF-8 text \(invalid start "
                                         r"byte at byte 0\): workload 'lm' reads UTF-8"):
        get_workload("lm", str(tmp_path / "utf16"))


def _cifar_records(labels: list[tuple[int, ...]], seed: int) -> tuple[bytes, np.ndarray]:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(len(labels), 3072), dtype=np.uint8)
    rows = [bytes(lab) + pixels[i].tobytes() for i, lab in enumerate(labels)]
    return b"".join(rows), pixels


def test_cifar10_binary_reader(tmp_path) -> None:
    folder = tmp_path / "cifar-10-batches-bin"  # the folder the archive extracts to
    folder.mkdir()
    first_pixels = None
    for i in range(1, 6):
        raw, pixels = _cifar_records([(i,), (9,)], seed=i)
        (folder / f"data_batch_{i}.bin").write_bytes(raw)
        first_pixels = pixels if i == 1 else first_pixels
    raw, _ = _cifar_records([(3,), (4,), (5,)], seed=9)
    (folder / "test_batch.bin").write_bytes(raw)
    data = load_cifar(str(tmp_path))
    assert data.source == "CIFAR-10" and data.num_classes == 10
    assert data.x_train.shape == (10, 3, 32, 32) and data.x_test.shape == (3, 3, 32, 32)
    assert data.y_train.tolist() == [1, 9, 2, 9, 3, 9, 4, 9, 5, 9]
    assert data.y_test.tolist() == [3, 4, 5]
    # Layout: 1024 red, 1024 green, 1024 blue, each 32x32 row-major; then per-channel standardised.
    raw_first = first_pixels[0].reshape(3, 32, 32).astype(np.float64)
    x = data.x_train.double()
    for c in range(3):
        assert np.corrcoef(x[0, c].flatten().numpy(), raw_first[c].flatten())[0, 1] > 0.9999
    assert x.mean(dim=(0, 2, 3)).abs().max() < 1e-5


def test_cifar100_reader_uses_fine_labels(tmp_path) -> None:
    raw, _ = _cifar_records([(1, 77), (2, 99)], seed=0)
    (tmp_path / "train.bin").write_bytes(raw)
    raw, _ = _cifar_records([(3, 42)], seed=1)
    (tmp_path / "test.bin").write_bytes(raw)
    w = get_workload("vision", str(tmp_path))
    assert w.data.source == "CIFAR-100" and w.data.num_classes == 100
    assert w.data.y_train.tolist() == [77, 99] and w.data.y_test.tolist() == [42]
    model = w.build_model(0)
    assert model.head.out_features == 100 and model(w.data.x_test).shape == (1, 100)


def test_cifar_errors(tmp_path) -> None:
    with pytest.raises(InputError, match="neither CIFAR-10 binaries .* nor CIFAR-100"):
        load_cifar(str(tmp_path))
    with pytest.raises(InputError, match="not a directory"):
        load_cifar(str(tmp_path / "nope"))
    (tmp_path / "train.bin").write_bytes(b"\x00" * 3075)
    (tmp_path / "test.bin").write_bytes(b"\x00" * 3074)
    with pytest.raises(InputError, match="3075 bytes is not a multiple of 3074"):
        load_cifar(str(tmp_path))
