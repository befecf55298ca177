"""ops/decode_linear.py and ops/decode_qkv.py on the GPU at the Qwen3-0.6B layer shapes: every
op against the unfused ops at 1-256 rows (heuristic tiles, split and unsplit), with programmatic dependent launch
inside a CUDA graph chained after other kernels, and the engine's greedy tokens with the op
switched on against the engine without it."""

import pytest
import torch

from bench.common import qwen3_06b_config
from bench.generate import random_model
from rlcu.ops import decode_linear as dl
from rlcu.ops.rmsnorm import rmsnorm_fwd
from rlcu.ops.swiglu import swiglu_fwd

pytestmark = pytest.mark.gpu

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _operands(op, M, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    N, K = SHAPES[op]
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).bfloat16()
    nw = (1 + 0.1 * torch.randn(K, device="cuda", generator=g)).bfloat16()
    r = torch.randn(M, N, device="cuda", generator=g).bfloat16() if op in ("o", "down") else None
    return x, w, nw, r


def _both(op, x, w, nw, r, cfg=None):
    if op == "qkv":
        return rmsnorm_fwd(x, nw, 1e-6)[0] @ w.t(), dl.decode_linear(x, w, nw, 1e-6, None, False, cfg)
    if op == "gate_up":
        return swiglu_fwd(rmsnorm_fwd(x, nw, 1e-6)[0] @ w.t()), dl.decode_linear(x, w, nw, 1e-6, None, True, cfg)
    return r.clone().addmm_(x, w.t()), dl.decode_linear(x, w, None, 1e-6, r.clone(), False, cfg)


@pytest.mark.parametrize("op", list(SHAPES))
@pytest.mark.parametrize("M", [1, 7, 64, 200, 256])
def test_ops_match_unfused(op, M):
    x, w, nw, r = _operands(op, M)
    N, K = SHAPES[op]
    heur = dl.heuristic_config(M, N // 2 if op == "gate_up" else N, K)
    for cfg in (heur, heur[:3] + (1,) + heur[4:], heur[:3] + (4,) + heur[4:]):
        ref, out = _both(op, x, w, nw, r, cfg)
        assert _rel(out, ref) < 1e-2, (op, M, cfg)


@pytest.mark.parametrize("M", [1, 7, 64, 200, 256])
def test_qkv_prep_fused_matches_unfused(M):
    """ops/decode_qkv.py at the 0.6B attention shape: q and the cache rows against rmsnorm,
    cuBLAS and qkv_prep, at the heuristic tiles and a few splits (the same bits launch after
    launch)."""
    from rlcu.model.rope import RopeSpec, inv_freq
    from rlcu.ops import decode_qkv as dq
    from rlcu.ops.qkv_prep import qkv_prep

    g = torch.Generator(device="cuda").manual_seed(3)
    Hq, Hk, D, K = 16, 8, 128, 1024
    x, w, nw, _ = _operands("qkv", M, seed=3)
    hw = [(1 + 0.1 * torch.randn(D, device="cuda", generator=g)).bfloat16() for _ in range(2)]
    pos = torch.randint(0, 8000, (M,), device="cuda", generator=g, dtype=torch.int32)
    slots = torch.randperm(4 * M, device="cuda", generator=g)[:M]
    kc = torch.zeros(M, 4, Hk, D, device="cuda", dtype=torch.bfloat16)
    kr, vr = kc.clone(), kc.clone()
    f = inv_freq(RopeSpec(theta=1e6), D, "cuda")
    ref = qkv_prep(rmsnorm_fwd(x, nw, 1e-6)[0] @ w.t(), *hw, pos, slots, kr, vr, Hq, Hk, D, 1e-6, f)
    heur = dq.heads_config(M, Hq + 2 * Hk, K)
    for cfg in (heur, heur[:3] + (1,) + heur[4:], heur[:3] + (4,) + heur[4:]):
        kc2, vc2 = kc.clone(), kc.clone()
        outs = [dq.decode_qkv(x, w, nw, 1e-6, *hw, pos, slots, kc2, vc2, Hq, Hk, D, f, cfg) for _ in range(3)]
        assert all(torch.equal(o, outs[0]) for o in outs[1:])
        assert _rel(outs[0], ref) < 1e-2 and _rel(kc2, kr) < 1e-2 and _rel(vc2, vr) < 1e-2, (M, cfg)


@pytest.mark.parametrize("op", ["qkv", "o", "gate_up", "down"])
def test_inline_reduce_same_bits_every_launch(monkeypatch, op):
    """Split-K under real concurrency: the partials added by each tile's last program give the
    same bits launch after launch (whichever program finishes last) and the reduce kernel's."""
    x, w, nw, r = _operands(op, 64, seed=2)
    cfg = (64, 32, 128, 4, 4, 4)
    outs = [_both(op, x, w, nw, r, cfg)[1] for _ in range(20)]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert all(c.eq(0).all() for c in dl._COUNTERS.values())
    monkeypatch.setitem(dl.CONFIGS, "inline_reduce", False)
    assert torch.equal(_both(op, x, w, nw, r, cfg)[1], outs[0])


def test_pdl_in_a_graph_after_other_kernels(monkeypatch):
    # each op reads what the kernel before it wrote: a torch kernel (launched without PDL), then
    # the o projection writing x in place (PDL, letting its dependent start early), then
    # gate_up reading that x (PDL): each must wait for the one before (gdc_wait)
    monkeypatch.setitem(dl.CONFIGS, "pdl", True)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.empty(64, 1024, device="cuda", dtype=torch.bfloat16)
    src = torch.randn(64, 1024, device="cuda", generator=g).bfloat16()
    o = torch.randn(64, 2048, device="cuda", generator=g).bfloat16()
    wo = (torch.randn(1024, 2048, device="cuda", generator=g) / 2048**0.5).bfloat16()
    wgu = (torch.randn(6144, 1024, device="cuda", generator=g) / 1024**0.5).bfloat16()
    nw = (1 + 0.1 * torch.randn(1024, device="cuda", generator=g)).bfloat16()
    out = torch.empty(64, 3072, device="cuda", dtype=torch.bfloat16)

    def step():
        x.copy_(src * 3.0)  # the producer, right before the ops
        dl.decode_linear(o, wo, None, 1e-6, x)
        out.copy_(dl.decode_linear(x, wgu, nw, 1e-6, None, True))

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(5):
        src.normal_(generator=torch.Generator(device="cuda").manual_seed(i))
        graph.replay()
        torch.cuda.synchronize()
        xr = (src * 3.0).addmm(o, wo.t())
        ref = swiglu_fwd(rmsnorm_fwd(xr, nw, 1e-6)[0] @ wgu.t())
        assert _rel(x, xr) < 1e-2 and _rel(out, ref) < 2e-2, i


@pytest.mark.parametrize("pdl", [False, True])
def test_engine_tokens_with_the_op(monkeypatch, pdl):
    from rlcu.engine import LLM, SamplingParams

    m = random_model(qwen3_06b_config(num_hidden_layers=4), "cuda")
    prompts = [{"prompt_token_ids": list(range(10 + i, 60 + 3 * i))} for i in range(12)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=True)
    outs = {}
    for fused in (False, True):
        monkeypatch.setitem(dl.CONFIGS, "enabled", fused)
        monkeypatch.setitem(dl.CONFIGS, "pdl", pdl and fused)
        llm = LLM(m, max_num_seqs=16, num_kv_blocks=256, warmup=False)  # a pool of its own size, whatever else is held
        outs[fused] = llm.generate(prompts, sp, use_tqdm=False)
        del llm
    # greedy at bf16 on random weights: the two paths are one rounding apart, so a near-tie may
    # flip a token and the sequences part there; until they part, the logprobs must agree (the
    # prefill step, > MAX_M tokens, is cuBLAS's either way: position 0 is the same computation)
    prefix = []
    for a, b in zip(outs[False], outs[True]):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        p = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        prefix.append(p)
        assert all(abs(x - y) < 0.05 for x, y in zip(a.outputs[0].logprobs[1:p], b.outputs[0].logprobs[1:p]))
    assert sum(p > 1 for p in prefix) >= 8 and sum(prefix) >= 12 * len(prefix), prefix
