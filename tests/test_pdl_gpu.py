"""Programmatic dependent launch (ops/pdl.py) on the GPU: the kernels that take it give the same
bits with it and without, eagerly, chained back to back and inside a CUDA graph, and the engine
samples the same tokens and logprobs either way (skipped without a GPU, or before sm_90)."""

import dataclasses

import pytest
import torch
from hf_util import make_hf_model

from rlcu import Qwen3
from rlcu.engine import LLM, SamplingParams
from rlcu.ops import pdl
from rlcu.ops.qkv_prep import qkv_prep
from rlcu.ops.rmsnorm import rmsnorm_fwd
from rlcu.ops.sampling import sample
from rlcu.ops.swiglu import swiglu_fwd

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _sm90():
    if not (torch.cuda.is_available() and pdl.available(torch.device("cuda"))):
        pytest.skip("programmatic dependent launch needs an sm_90+ GPU and triton >= 3.4")


def _both(fn):
    """fn() with PDL on, then off -> (on, off)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(pdl.CONFIGS, "enabled", True)
        on = fn()
        torch.cuda.synchronize()
        mp.setitem(pdl.CONFIGS, "enabled", False)
        off = fn()
        torch.cuda.synchronize()
    return on, off


def _chain(x, w, heads):
    # every PDL kernel reading what the PDL kernel just before it wrote: each must wait for it.
    # The first norm is large (a quarter millisecond), so that a successor which did not wait
    # would read its output while it is being written.
    q_w, k_w, pos, slots, kc, vc, Hq, Hk, D = heads
    y = rmsnorm_fwd(x, w, 1e-6)[0]
    a = swiglu_fwd(y)
    b = rmsnorm_fwd(a[: pos.shape[0], : (Hq + 2 * Hk) * D].contiguous(), w[: (Hq + 2 * Hk) * D], 1e-6)[0]
    q = qkv_prep(b, q_w, k_w, pos, slots, kc, vc, Hq, Hk, D, 1e-6, 1e6)
    n = q.shape[0]
    logits = (q.view(n, -1).float() @ torch.ones(Hq * D, 4096, device="cuda") * 1e-3).to(torch.bfloat16)
    f = torch.ones(n, device="cuda")
    tok, lp = sample(logits, f * 0.7, torch.zeros(n, dtype=torch.int32, device="cuda"), f, f * 0.0,
                     torch.arange(n, device="cuda"), torch.zeros(n, dtype=torch.int64, device="cuda"))
    return y, a, b, q, kc.clone(), vc.clone(), tok, lp


def _operands():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(65536, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = 1 + 0.1 * torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=g)
    Hq, Hk, D, n = 8, 4, 64, 64
    kc = torch.zeros(8, 16, Hk, D, device="cuda", dtype=torch.bfloat16)
    heads = (1 + 0.1 * torch.randn(D, device="cuda", dtype=torch.bfloat16, generator=g),
             1 + 0.1 * torch.randn(D, device="cuda", dtype=torch.bfloat16, generator=g),
             torch.arange(n, device="cuda", dtype=torch.int32) * 7, torch.arange(n, device="cuda"), kc,
             torch.zeros_like(kc), Hq, Hk, D)
    return x, w, heads


def test_chained_kernels_same_bits_with_and_without_pdl():
    x, w, heads = _operands()
    on, off = _both(lambda: _chain(x, w, heads))
    for i, (a, b) in enumerate(zip(on, off)):
        assert torch.equal(a, b), i


def test_graph_of_pdl_kernels_equals_eager():
    x, w, heads = _operands()
    x = x[:4096].clone()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(pdl.CONFIGS, "enabled", False)
        ref = _chain(x, w, heads)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _chain(x, w, heads)  # compiled outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _chain(x, w, heads)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(out, ref)):
        assert torch.equal(a, b), i


def test_engine_same_tokens_with_and_without_pdl(tmp_path):
    folder = make_hf_model(tmp_path)[1]
    m = Qwen3.from_pretrained(folder, device="cuda", dtype=torch.bfloat16)
    prompts = [{"prompt_token_ids": [5 + i, 17, 3 * i + 1] * (1 + i % 5)} for i in range(24)]
    sp = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, logprobs=True, seed=3)

    def run():  # graphs captured at the engine's start: under the setting of this call
        outs = LLM(m, num_kv_blocks=512, max_num_seqs=32).generate(prompts, dataclasses.replace(sp), use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    on, off = _both(run)
    assert on == off
