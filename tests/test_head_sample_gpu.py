"""ops/head_sample.py on the GPU at the Qwen3 head shapes (V = 151936, K = 1024 and 4096, bf16):
at 1-256 rows the kernel's tokens are exactly those `sampling.sample` draws from the logits it
wrote (temperature, greedy, top-k + top-p rows), its logits within bf16 rounding of cuBLAS's,
inside a CUDA graph too; and the engine with it on generates what it generates without it, up to
where a near tie between the two GEMMs' roundings parts a sequence."""

import pytest
import torch

from bench.common import qwen3_06b_config
from bench.generate import random_model
from rlcu.ops import head_sample as hs
from rlcu.ops.sampling import sample

pytestmark = pytest.mark.gpu
V = 151936


def _params(B):
    f = torch.ones(B, device="cuda")
    T = torch.where(torch.arange(B, device="cuda") % 5 == 1, 0.0, 0.6) * f  # every fifth row greedy
    k = torch.where(torch.arange(B, device="cuda") % 3 == 2, 50, 0).int()
    p = torch.where(torch.arange(B, device="cuda") % 4 == 3, 0.9, 1.0) * f
    return (T, k, p, f * 0.0, torch.arange(B, device="cuda", dtype=torch.int64) * 3 + 1,
            torch.full((B,), 9, device="cuda", dtype=torch.int64))


@pytest.mark.parametrize("K", [1024, 4096])
@pytest.mark.parametrize("B", [1, 37, 64, 256])
def test_tokens_are_the_samplers_of_its_logits(K, B):
    g = torch.Generator(device="cuda").manual_seed(K + B)
    h = torch.randn(B, K, device="cuda", generator=g).bfloat16()
    W = (torch.randn(V, K, device="cuda", generator=g) * 0.05).bfloat16()
    params = _params(B)
    toks, lps, logits = hs.head_sample(h, W, *params)
    ref = (h @ W.t()).float()
    assert float((logits.float() - ref).norm() / ref.norm()) < 4e-3
    t2, lp2 = sample(logits, *params)
    assert torch.equal(toks, t2)
    torch.testing.assert_close(lps, lp2, rtol=1e-5, atol=1e-5)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        out = hs.head_sample(h, W, *params)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], toks) and torch.equal(out[1], lps) and torch.equal(out[2], logits)


def test_engine_with_it_on(monkeypatch):
    from rlcu.engine import LLM, SamplingParams

    m = random_model(qwen3_06b_config(num_hidden_layers=4), "cuda")
    prompts = [{"prompt_token_ids": list(range(10 + i, 60 + 3 * i))} for i in range(12)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=True)
    outs = {}
    for on in (False, True):
        monkeypatch.setitem(hs.CONFIGS, "enabled", on)
        llm = LLM(m, max_num_seqs=16, num_kv_blocks=256, warmup=False)
        outs[on] = llm.generate(prompts, sp, use_tqdm=False)
        del llm
    # greedy on random weights: cuBLAS's logits and the kernel's may round a near tie apart; until
    # the sequences part, their logprobs agree
    prefix = []
    for a, b in zip(outs[False], outs[True]):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        p = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        prefix.append(p)
        assert all(abs(x - y) < 0.05 for x, y in zip(a.outputs[0].logprobs[:p], b.outputs[0].logprobs[:p]))
    assert sum(p > 1 for p in prefix) >= 8 and sum(prefix) >= 12 * len(prefix), prefix
