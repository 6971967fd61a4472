"""Tiny Hugging Face transformers models built in code (no downloads), for the HF recipes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VOCAB = 100


def build(kind: str, attn: str = "sdpa", layers: int = 2, hidden: int = 32,
          seed: int = 0) -> nn.Module:
    """``gpt2`` (GPT2LMHeadModel), ``llama`` (LlamaForCausalLM) or ``bert``
    (BertForMaskedLM) from a small config, dropout on, in train mode."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "gpt2":
        model: nn.Module = tf.GPT2LMHeadModel(tf.GPT2Config(
            n_layer=layers, n_embd=hidden, n_head=2, n_positions=64, vocab_size=VOCAB,
            bos_token_id=0, eos_token_id=0, attn_implementation=attn))  # dropouts 0.1
    elif kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
            num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
            max_position_embeddings=64, attention_dropout=0.1, bos_token_id=0,
            eos_token_id=0, pad_token_id=0, attn_implementation=attn))
    elif kind == "bert":
        model = tf.BertForMaskedLM(tf.BertConfig(
            num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
            num_attention_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
            attn_implementation=attn))  # hidden and attention dropout 0.1
    else:
        raise ValueError(f"unknown model kind {kind!r}: gpt2, llama or bert")
    return model.train()


def batch(kind: str, size: int = 2, seq: int = 16, seed: int = 1) -> dict[str, torch.Tensor]:
    """Token ids and labels (causal LM: labels = ids; masked LM: 15% of positions)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (size, seq), generator=g)
    labels = ids.clone()
    if kind == "bert":
        masked = torch.rand(size, seq, generator=g) < 0.15
        masked[:, 0] = True
        labels[~masked] = -100
        ids = ids.masked_fill(masked, 3)
    return {"input_ids": ids, "labels": labels}


def hf_loss(out: Any) -> torch.Tensor:
    """The loss the model computed itself from ``labels``."""
    loss: torch.Tensor = out.loss
    return loss
