"""bench/generate.py's per-kernel-class split bound on a hand example, and bench/bound_replay.py's
CPU replay of the step log against the real engine's on a tiny model (with preemptions)."""

import pytest
import torch

from bench.bound_replay import replay
from bench.generate import bound_seconds, bound_split_seconds, split_step_seconds
from rlcu.engine import LLM, SamplingParams
from rlcu.model.causal_lm import Qwen3
from rlcu.model.config import Qwen3Config

# 2 layers, hidden 64, q 4 x 16, kv 2 x 16, MLP 128, vocab 1000, untied head
CFG = Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


def test_split_bound_by_hand():
    # matmul params: a layer's attention 64 x (64 + 2 x 32) + 64 x 64 = 12288, its MLP 3 x 128 x 64 = 24576,
    # two layers 73728; the head 64000. K/V a token: 2 layers x (K, V) x 32 x 2 bytes = 256.
    W = 400_000  # the weights' bytes, as the caller states them; the untied embedding (128000 bytes) is not read
    # decode step of 4 rows, 100 context tokens: GEMM bytes 400000 - 128000 + 4 rows x 1000 x 4 (logits) = 288000,
    # FLOPs 2 x 73728 x 4 + 2 x 64000 x 4 = 1101824; attention 100 x 256 = 25600 bytes
    g, a = split_step_seconds(CFG, W, 4, 4, 100, bandwidth=1e6, peak=1e7)
    assert g == pytest.approx(0.288) and a == pytest.approx(0.0256)
    g, a = split_step_seconds(CFG, W, 4, 4, 100, bandwidth=1e6, peak=1e6)  # compute-bound GEMMs
    assert g == pytest.approx(1.101824) and a == pytest.approx(0.0256)
    # a prefill step of 50 tokens in 2 sequences: the head's FLOPs for 2 rows only
    g, a = split_step_seconds(CFG, W, 50, 2, 50, bandwidth=1e6, peak=1e6)
    assert g == pytest.approx((2 * 73728 * 50 + 2 * 64000 * 2) / 1e6) and a == pytest.approx(50 * 256 / 1e6)
    # summed over a log: total and decode; the compute-bound decode step adds attention on top of its FLOPs,
    # where the overlapping bound takes max(weights + K/V, FLOPs)
    stats = {"step_log": [(50, 2, 50, True, 0.0), (4, 4, 100, True, 0.0)]}
    tot, dec = bound_split_seconds(stats, CFG, W, 1e6, peak=1e6)
    assert dec == pytest.approx(1.101824 + 0.0256) and tot == pytest.approx(dec + 7.6288 + 0.0128)
    old_tot, old_dec, _, _ = bound_seconds(stats, CFG, W, 1e6)  # its peak is the H200's: memory-bound here
    assert old_dec == pytest.approx(0.4256) and old_tot == pytest.approx(0.4256 + (W + 50 * 256) / 1e6)


def test_replay_is_the_engines_step_log():
    """The engine on a tiny model and the replay (no model) over the same lengths, on a pool of
    12 blocks that forces preemptions: the same steps, tokens, rows and contexts."""
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    g = torch.Generator().manual_seed(0)
    plens = torch.randint(5, 30, (6,), generator=g).tolist()
    olens = torch.randint(5, 30, (6,), generator=g).tolist()
    prompts = [torch.randint(0, 64, (n,), generator=g).tolist() for n in plens]
    llm = LLM(Qwen3.from_config(cfg, "cpu", torch.float32, 0), max_num_seqs=4, max_num_batched_tokens=48,
              num_kv_blocks=12, block_size=8)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True, seed=i) for i, o in enumerate(olens)],
                 use_tqdm=False)
    st = replay(prompts, olens, num_blocks=12, max_model_len=llm.max_model_len, block_size=8, max_num_seqs=4,
                max_num_batched_tokens=48)
    assert st["preemptions"] > 0 and st["preemptions"] == llm.stats["preemptions"]
    assert [s[:3] for s in st["step_log"]] == [s[:3] for s in llm.stats["step_log"]]
    assert st["output_tokens"] == sum(olens)
