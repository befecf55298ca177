"""The decode list kernel (ops/paged_decode_list.py) on the GPU at the Qwen3-0.6B attention shape
(16 q heads, 8 KV heads, head_dim 128, bf16, block size 16): against the twin at 1-256 sequences
of mixed lengths with the machine's own plan; the in-kernel combine under real concurrency (one
work list over many launches, as the layers of a step use it: the same bits every launch); and
a CUDA graph of the work list and the launches replayed over other lengths."""

import pytest
import torch

import rlcu.ops.paged_attention as pa

pytestmark = pytest.mark.gpu
Hq, Hk, D, BS = 16, 8, 128, 16


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _batch(B, lo, hi, seed=0, pool=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (B,), generator=g, device="cuda", dtype=torch.int32)
    W = (hi + BS - 1) // BS
    nb = B * W + 4
    kc, vc = pool or (torch.randn(nb, BS, Hk, D, generator=g, device="cuda").bfloat16(),
                      torch.randn(nb, BS, Hk, D, generator=g, device="cuda").bfloat16())
    tables = torch.randperm(kc.shape[0], generator=g, device="cuda")[: B * W].int().view(B, W)
    q = torch.randn(B, Hq, D, generator=g, device="cuda").bfloat16()
    cu = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    return [q, kc, vc, tables, cu, lens], W * BS


@pytest.fixture
def list_kernel(monkeypatch):
    monkeypatch.setitem(pa.CONFIGS, "decode_plan", {**pa.CONFIGS["decode_plan"], "kernel": "list"})


@pytest.mark.parametrize("B,lo,hi", [(1, 3000, 3000), (1, 40000, 40000), (7, 1, 40), (64, 200, 2048), (256, 200, 2048),
                                     (32, 100, 8192)])
def test_matches_twin(list_kernel, B, lo, hi):
    args, max_k = _batch(B, lo, hi)
    ref = pa.paged_attention_ref(*args, 1, max_k, D**-0.5)
    assert _rel(pa.paged_attention(*args, 1, max_k, D**-0.5), ref) < 1e-2


def test_one_work_list_many_launches_same_bits(list_kernel):
    """28 launches on one work list (a step's layers): each launch's last chunk puts the counters
    back, so every launch combines again, and whichever program finishes a sequence last, the
    bits are the same."""
    args, max_k = _batch(64, 200, 2048, seed=3)
    work = pa.decode_work(args[4], args[5], Hk)
    assert int(work.meta[1]) > 64  # sequences are split: the combine runs
    outs = [pa.paged_attention(*args, 1, max_k, D**-0.5, None, work) for _ in range(28)]
    torch.cuda.synchronize()
    assert work.count.eq(0).all()
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    assert _rel(outs[0], pa.paged_attention_ref(*args, 1, max_k, D**-0.5)) < 1e-2


def test_graph_replays_other_lengths(list_kernel):
    """A graph of the work list and three launches, captured once, serves other lengths of the
    same batch size (the grid follows sizes only)."""
    args, max_k = _batch(64, 200, 2048, seed=5)
    q, kc, vc, tables, cu, lens = args
    out = torch.empty(3, *q.shape, device="cuda", dtype=q.dtype)

    def step():
        work = pa.decode_work(cu, lens, Hk)
        for i in range(3):
            out[i] = pa.paged_attention(q, kc, vc, tables, cu, lens, 1, max_k, D**-0.5, None, work)

    step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for seed in (6, 7):
        lens.copy_(_batch(64, 1, 2048, seed=seed, pool=(kc, vc))[0][5])
        g.replay()
        torch.cuda.synchronize()
        ref = pa.paged_attention_ref(q, kc, vc, tables, cu, lens, 1, max_k, D**-0.5)
        for i in range(3):
            assert _rel(out[i], ref) < 1e-2
