"""Multi-turn episodes on the GPU in exact mode, bf16, at the Qwen3-0.6B shape (random weights,
the final norm scaled to a mean entropy of about 2.9 nats): 16 starts x 4 episodes of 4 turns,
environment answers of 24 tokens after each turn (a callback that sleeps a few ms, so episodes
park and resume out of step), through the decode graphs and the prefill graphs: every model
token's logprob equals the trainer's forward over the whole trajectory bit for bit."""

import time

import pytest
import torch

from bench.common import scale_to_entropy
from bench.generate import random_model
from rlcu.engine import LLM, SamplingParams
from rlcu.model.config import Qwen3Config

pytestmark = pytest.mark.gpu
TURNS, ENV_TOKENS = 4, 24


def test_multi_turn_exact_equals_trainer_bf16_06b():
    cfg = Qwen3Config()
    m = random_model(cfg, "cuda")
    scale_to_entropy(m, 2.9)
    m.exact = True
    g = torch.Generator().manual_seed(0)
    starts = [torch.randint(0, cfg.vocab_size, (int(L),), generator=g).tolist()
              for L in torch.randint(16, 160, (16,), generator=g)]

    def on_turn(i, turn_ids, reason):
        time.sleep(0.002 * (i % 5))  # episodes answered out of step: parks, resumes, mixed steps
        k = on_turn.turns[i] = on_turn.turns.get(i, 0) + 1
        if k >= TURNS:
            return None
        return [(i * 131 + k * 17 + t * 7) % cfg.vocab_size for t in range(ENV_TOKENS)]

    on_turn.turns = {}
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=48, ignore_eos=True, seed=9, logprobs=True)
    llm = LLM(m, num_kv_blocks=4096, max_num_batched_tokens=1024)
    eps = llm.run_episodes(starts, sp, on_turn)
    assert llm.runner.use_graphs
    seqs = [e.start_ids + e.ids for e in eps]
    tokens = torch.tensor([t for s in seqs for t in s], device="cuda")
    cu = torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist(), dtype=torch.int32,
                      device="cuda")
    lp = m.forward(tokens, cu, temperature=sp.temperature, grad=False).float().cpu()
    model_tokens = 0
    for e, start in zip(eps, cu[:-1].tolist()):
        assert e.turns == TURNS and e.error is None, (e.turns, e.finish_reason, e.error)
        mask = torch.tensor(e.model_mask, dtype=torch.bool)
        want = lp[start + len(e.start_ids):start + len(e.start_ids) + len(e.ids)]
        assert torch.equal(torch.tensor(e.logprobs, dtype=torch.float32)[mask], want[mask])
        model_tokens += int(mask.sum())
    assert model_tokens == len(eps) * TURNS * sp.max_tokens
