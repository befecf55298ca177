"""ops/l2_prefetch.py on the GPU: the kernel over a layer's weights of the Qwen3-0.6B shape, eagerly
and inside a CUDA graph, changes no byte; the engine's tokens and logprobs with the decode steps'
prefetches on (after each attention, and before it) are bit for bit those without (a hint
changes no value), eagerly and through the decode graphs."""

import pytest
import torch

from bench.common import qwen3_06b_config
from bench.generate import random_model
from rlcu.engine.paged_forward import decode_prefetch
from rlcu.ops import l2_prefetch as l2

pytestmark = pytest.mark.gpu


def test_prefetch_changes_no_byte():
    m = random_model(qwen3_06b_config(num_hidden_layers=3), "cuda")
    before = m.flat.clone()
    for lo, hi in decode_prefetch(m):
        l2.l2_prefetch(m.flat, lo, hi)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for lo, hi in decode_prefetch(m):
            l2.l2_prefetch(m.flat, lo, hi)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(m.flat, before)


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("eager", [False, True])
def test_engine_bits_are_the_same(monkeypatch, early, eager):
    from rlcu.engine import LLM, SamplingParams

    m = random_model(qwen3_06b_config(num_hidden_layers=4), "cuda")
    prompts = [{"prompt_token_ids": list(range(10 + i, 60 + 3 * i))} for i in range(12)]
    sp = SamplingParams(n=2, temperature=0.8, max_tokens=24, ignore_eos=True, seed=3, logprobs=True)
    outs = []
    for on in (False, True):
        monkeypatch.setitem(l2.CONFIGS, "enabled", on)
        monkeypatch.setitem(l2.CONFIGS, "early", early)
        llm = LLM(m, max_num_seqs=32, num_kv_blocks=256, warmup=False, enforce_eager=eager)
        outs.append([(o.token_ids, o.logprobs) for r in llm.generate(prompts, sp, use_tqdm=False) for o in r.outputs])
        del llm
    assert outs[0] == outs[1]
