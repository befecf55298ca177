"""The sharded optimizer's scenario at 2 ranks (tests/integration/test_parallel_zero.py) and the
failure tests that run it until a rank dies: a tiny untied model, a seeded global batch a step
(the same on every rank, which takes its share) and the optimizer's settings."""

from __future__ import annotations

import torch

import rlcu
from rlcu.config import OptimConfig

TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)


def zero_model(dtype=torch.float32):
    return rlcu.Qwen3.from_config(rlcu.Qwen3Config(**TINY), seed=1, dtype=dtype)


def zero_batches(step):
    """Four sequences a step (two per rank at 2 ranks), token weights normalised globally."""
    g = torch.Generator().manual_seed(100 + step)
    seqs = [torch.randint(0, 61, (int(n),), generator=g) for n in torch.randint(3, 9, (4,), generator=g)]
    n_tok = sum(len(s) - 1 for s in seqs)
    return seqs, n_tok


def zero_optim(**kw):
    return OptimConfig(lr=3e-2, max_grad_norm=0.5, weight_decay=0.1, **kw)
