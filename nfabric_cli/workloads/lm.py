"""`lm`: a character-level decoder-only GPT on CPython's `pydoc_data.topics` (or `input.txt`).

The corpus is the help text of every topic in `pydoc_data.topics` (about 465 KB of English
and code that ships with CPython), concatenated in sorted key order, split 90/10 into train
and validation text. Its SHA-256 is the data fingerprint: it changes with the Python version,
so a profile records which text it was calibrated on.

The model is pre-LN with a Pythia-like layout at tiny size: `embed`, `pos_embed`,
`blocks.N.{ln1,attn.qkv,attn.proj,ln2,mlp.fc_in,mlp.fc_out}`, `ln_f`, and an untied output
layer `head`, so the LM output layer can be routed on its own.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nfabric_cli.errors import InputError
from nfabric_cli.workloads.common import BaseWorkload, model_device, warmup_cosine
from nfabric_cli.workloads.layers import Block, gpt_init


@dataclass(frozen=True)
class Corpus:
    """Character ids of the train and validation text, the vocabulary and the text's hash."""

    train: torch.Tensor  # int64 ids
    val: torch.Tensor
    vocab: str
    fingerprint: str
    source: str

    def unigram_loss(self) -> float:
        """Validation cross-entropy (nats/char) of the train set's character frequencies:
        the loss a model that ignores context would reach."""
        counts = torch.bincount(self.train, minlength=len(self.vocab)).double() + 1.0
        log_p = (counts / counts.sum()).log()
        return float(-log_p[self.val].mean())


def pydoc_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "".join(topics[key] for key in sorted(topics))


@functools.lru_cache(maxsize=2)
def load_corpus(data_dir: str | None = None) -> Corpus:
    """The pydoc topics corpus, or `data_dir/input.txt` (UTF-8) when a directory is given."""
    if data_dir is None:
        text, source = pydoc_text(), "pydoc_data.topics"
    else:
        path = Path(data_dir) / "input.txt"
        if not path.is_file():
            raise InputError(
                f"--data-dir {data_dir} has no input.txt (UTF-8 text) for workload 'lm'"
            )
        try:
            text, source = path.read_text(encoding="utf-8"), str(path)
        except UnicodeDecodeError as exc:
            raise InputError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}): "
                             "workload 'lm' reads UTF-8") from None
    if len(text) < 10 * LMWorkload.context:
        raise InputError(f"corpus {source} is too short ({len(text)} characters)")
    vocab = "".join(sorted(set(text)))
    lookup = {ch: i for i, ch in enumerate(vocab)}
    ids = torch.tensor([lookup[ch] for ch in text], dtype=torch.int64)
    split = int(0.9 * len(ids))
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return Corpus(ids[:split], ids[split:], vocab, digest, source)


class GPT(nn.Module):
    """Decoder-only Transformer: token + position embeddings, causal pre-LN blocks, `head`."""

    def __init__(self, vocab: int, context: int, dim: int, depth: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos_embed = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, causal=True) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)  # untied from `embed` on purpose
        gpt_init(self, depth)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        h = self.embed(ids) + self.pos_embed(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


class LMWorkload(BaseWorkload):
    """Character-level GPT; metric: validation loss in nats per character (lower is better).

    Training samples are non-overlapping windows of `context + 1` characters on a grid whose
    offset moves every epoch, so later epochs see the text cut at different places.
    """

    name = "lm"
    metric_name = "val_loss"
    higher_is_better = False
    default_steps = 400
    batch_size = 16
    head_selector = "head.*"
    context, dim, depth, heads, lr = 64, 64, 3, 4, 2e-3
    eval_windows = 96  # fixed, evenly spaced validation windows: evaluation stays well under 1 s

    def __init__(self, data_dir: str | None = None) -> None:
        self.corpus = load_corpus(data_dir)
        self.description = f"char-level GPT, {self.corpus.source}"
        # One window of slack so every epoch's shifted grid fits inside the train text.
        self._windows = (len(self.corpus.train) - 1) // self.context - 1
        starts = np.linspace(0, len(self.corpus.val) - self.context - 1, self.eval_windows)
        self._val_starts = torch.from_numpy(starts.astype(np.int64))

    def _train_size(self) -> int:
        return self._windows

    def _gather(self, indices: np.ndarray, epoch: int) -> tuple[torch.Tensor, ...]:
        shift = (epoch * 29) % self.context  # 29 is coprime to 64: every offset in turn
        starts = torch.from_numpy(indices) * self.context + shift
        return _windows(self.corpus.train, starts, self.context)

    def _make_model(self) -> nn.Module:
        return GPT(len(self.corpus.vocab), self.context, self.dim, self.depth, self.heads)

    def make_optimizer(self, params: Any, total_steps: int) -> tuple[torch.optim.Optimizer, Any]:
        opt = torch.optim.AdamW(params, lr=self.lr, betas=(0.9, 0.98), weight_decay=0.01)
        return opt, warmup_cosine(opt, total_steps, warmup_frac=0.05)

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        device = model_device(model)
        inputs, targets = (t.to(device) for t in batch)
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def _metric(self, model: nn.Module) -> float:
        inputs, targets = _windows(self.corpus.val, self._val_starts, self.context)
        loss = self.loss(model, (inputs, targets))
        return float(loss) if math.isfinite(float(loss)) else float("inf")

    def unigram_loss(self) -> float:
        return self.corpus.unigram_loss()

    def data_fingerprint(self) -> str:
        return self.corpus.fingerprint


def _windows(ids: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, ...]:
    """(inputs, next-character targets), each (len(starts), context)."""
    rows = ids[starts.unsqueeze(1) + torch.arange(context + 1)]
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
