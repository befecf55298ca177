"""Exact mode on the GPU in bf16 at the Qwen3-0.6B shape (random weights, the final norm scaled
so that the mean entropy is about 2.9 nats, as in a trained model): the engine's logprobs of
256 sampled sequences equal Qwen3.forward's (and forward_backward's) bit for bit, through the
CUDA graphs, chunked prefill and n = 8; and a few of them generated in other batches give the
same tokens and bits. The default mode's mismatch is measured beside it and reported (printed,
and written to $OUT/exact_gpu.json when OUT is set)."""

import json
import os

import pytest
import torch

from bench.common import scale_to_entropy
from bench.generate import random_model
from rlcu.engine import LLM, SamplingParams
from rlcu.model.config import Qwen3Config

pytestmark = pytest.mark.gpu

PROMPTS, N_SAMPLES, NEW, TEMP = 32, 8, 128, 1.0


def _prompts(V, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(16, 200, (n,), generator=g).tolist()
    return [torch.randint(0, V, (L,), generator=g).tolist() for L in lens]


def _run(m, prompts, **engine):
    sp = SamplingParams(n=N_SAMPLES, temperature=TEMP, max_tokens=NEW, ignore_eos=True, seed=5, logprobs=True)
    llm = LLM(m, **engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    gens = [(p, c.token_ids, c.logprobs) for p, o in zip(prompts, outs) for c in o.outputs]
    llm.sleep()
    del llm
    torch.cuda.empty_cache()
    return gens


def _trainer_lp(m, gens, fused=False):
    seqs = [p + t for p, t, _ in gens]
    tokens = torch.tensor([x for s in seqs for x in s], device="cuda")
    cu = torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist(), device="cuda",
                      dtype=torch.int32)
    if fused:  # the GRPO / PPO step's path: the head's forward inside forward_backward
        lp, _ = m.forward_backward(tokens, cu, lambda lp_c, ent_c, idx: (torch.zeros_like(lp_c), None),
                                   temperature=TEMP, return_entropy=True)
        m.release_grads()
    else:
        lp = m.forward(tokens, cu, temperature=TEMP, grad=False)
    want, starts = [], cu[:-1].tolist()
    for (p, t, _), s in zip(gens, starts):
        want.append(lp[s + len(p):s + len(p) + len(t)].float().cpu())
    return torch.cat(want)


def _stats(eng, tr):
    d = (tr - eng).double()
    r = d.exp()
    return {"tokens": d.numel(), "abs_mean": float(d.abs().mean()), "abs_max": float(d.abs().max()),
            "exact_frac": float((d == 0).double().mean()), "ratio_p01": float(r.quantile(0.01)),
            "ratio_p99": float(r.quantile(0.99)), "outside_0.8_1.2": float(((r < 0.8) | (r > 1.2)).double().mean())}


def test_exact_engine_equals_trainer_bf16_06b():
    cfg = Qwen3Config()  # the published 0.6B shape
    m = random_model(cfg, "cuda")
    scale_to_entropy(m, 2.9)
    prompts = _prompts(cfg.vocab_size, PROMPTS)
    engine = {"num_kv_blocks": 4096, "max_num_batched_tokens": 2048}  # prefills come in chunks
    report = {}
    try:
        for mode in (False, True):
            m.exact = mode  # the model's mode, which the engines below read
            gens = _run(m, prompts, **engine)
            eng = torch.tensor([x for _, _, lps in gens for x in lps])
            report["exact" if mode else "default"] = _stats(eng, _trainer_lp(m, gens))
            if mode:
                assert torch.equal(eng, _trainer_lp(m, gens)), report
                assert torch.equal(eng, _trainer_lp(m, gens, fused=True)), report
                # other batches: 3 prompts alone in an engine of 5 sequences a step, eager
                few = _run(m, prompts[:3], num_kv_blocks=1024, max_num_seqs=5, enforce_eager=True)
                assert few == gens[:len(few)]
    finally:
        print(json.dumps(report, indent=1))
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "exact_gpu.json"), "w") as f:
                json.dump(report, f, indent=1)
    assert report["exact"]["exact_frac"] == 1.0
