"""Tiny HuggingFace models built from a config, offline (the optional `nfabric_cli[hf]` extra).

They carry the real parameter names and module structure of BERT / DistilBERT classifiers
and GPT-NeoX (Pythia) causal LMs, so selectors, bucket plans and capacity projections can be
tried on realistic layouts without downloading weights: nothing here touches the network.
Use them wherever a command takes `--model`, e.g.
`nfabric compile-profile P --model nfabric_cli.workloads.hf:tiny_gpt_neox`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from nfabric_cli.errors import InputError


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise InputError(
            "the HuggingFace models need the optional extra: pip install 'nfabric_cli[hf]'"
        ) from None
    return transformers


def tiny_bert(num_labels: int = 2) -> nn.Module:
    """BertForSequenceClassification: 2 layers, hidden 64, vocab 1000."""
    tf = _transformers()
    cfg = tf.BertConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, num_labels=num_labels,
    )
    return tf.BertForSequenceClassification(cfg)


def tiny_distilbert(num_labels: int = 2) -> nn.Module:
    """DistilBertForSequenceClassification: 2 layers, dim 64 (the paper's SST-2 family)."""
    tf = _transformers()
    cfg = tf.DistilBertConfig(
        vocab_size=1000, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
        max_position_embeddings=128, num_labels=num_labels,
    )
    return tf.DistilBertForSequenceClassification(cfg)


def tiny_gpt_neox() -> nn.Module:
    """GPTNeoXForCausalLM with Pythia's naming (`gpt_neox.layers.N...`, untied output layer `lm_head`)."""
    tf = _transformers()
    cfg = tf.GPTNeoXConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=256, max_position_embeddings=128, tie_word_embeddings=False,
    )
    return tf.GPTNeoXForCausalLM(cfg)


#: HF model factories by short name, for `--model nfabric_cli.workloads.hf:NAME`.
HF_MODELS = {"tiny_bert": tiny_bert, "tiny_distilbert": tiny_distilbert, "tiny_gpt_neox": tiny_gpt_neox}
