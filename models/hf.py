"""Tiny random-initialised transformers models, for ``--model gradequiv.models.hf:llama``.

Built from a config (no download), with dropout on, so HF's own gradient
checkpointing (``--impl hf``, a toggle) meets the same properties as any
other implementation. Needs ``pip install 'gradequiv[hf]'``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gradequiv.models.library import import_transformers
from gradequiv.models.user_model import UserModel

__all__ = ["gpt2", "llama"]

VOCAB, WIDTH, LAYERS, HEADS, SEQ, BATCH = 64, 32, 2, 2, 12, 2


def _loss(outputs: Any, targets: Tensor) -> Tensor:
    logits = outputs.logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def _batch(seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return stream[:, :-1].clone(), stream[:, 1:].clone()


def llama(seed: int) -> UserModel:
    """A 2-layer Llama (eager attention, attention dropout 0.1); segments: its decoder layers."""
    transformers = import_transformers("gradequiv.models.hf:...")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        max_position_embeddings=SEQ, attention_dropout=0.1, attn_implementation="eager",
        use_cache=False)  # training: a KV cache would be appended to again by the recompute
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    tokens, targets = _batch(seed)
    return UserModel(model, (tokens,), targets, _loss,
                     segments=[f"model.layers.{i}" for i in range(LAYERS)])


def gpt2(seed: int) -> UserModel:
    """A 2-layer GPT-2 (dropout 0.1 on embeddings, attention and residuals); segments: its
    blocks."""
    transformers = import_transformers("gradequiv.models.hf:...")
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=SEQ,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, attn_implementation="eager",
        use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    tokens, targets = _batch(seed)
    return UserModel(model, (tokens,), targets, _loss,
                     segments=[f"transformer.h.{i}" for i in range(LAYERS)])
