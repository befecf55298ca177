"""The decode list kernel (ops/paged_decode_list.py): its work list (every chunk once, longest
first, within the grid's cap), its output against the twin, the in-kernel combine (the counters
back at zero for the next layer, the bits independent of which chunk finishes last), and one
work list shared by the layers of a step. On the CPU through TRITON_INTERPRET=1."""

import os

import pytest
import torch
from support.hf_util import rel_err
from support.paged_util import paged_setup

import rlcu.ops.paged_attention as pa
from rlcu.ops.paged_decode_list import DecodeWork

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TOL = 1e-5 if INTERPRET else 3e-3
PLANS = {  # name: decode_plan overrides (num_sms = 2 below, so that tiny batches split)
    "fine": dict(kernel="list", BN=16, min_part=16, units_per_sm=16),
    "coarse": dict(kernel="list", BN=16, min_part=48, units_per_sm=2),
    "one_chunk": dict(kernel="list", BN=32, min_part=1024),
    "many": dict(kernel="list", BN=16, min_part=16, units_per_sm=32),  # over 16 chunks: blocks of the combine
}
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


@pytest.fixture
def list_plan(monkeypatch, request):
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    monkeypatch.setitem(pa.CONFIGS, "decode_plan", {**pa.CONFIGS["decode_plan"], **PLANS[request.param]})
    monkeypatch.setattr(pa, "sm_count", lambda device: 2)
    return PLANS[request.param]


def _expected_units(q_lens, ctx, C):
    """(sequence, chunk, keys) of every unit the list must hold."""
    out = []
    for s, (q, L) in enumerate(zip(q_lens, ctx)):
        if q == 0:
            continue
        n = max(-(-L // C), 1)
        out += [(s, c, min(C, L - c * C)) for c in range(n)]
    return out


@pytest.mark.parametrize("list_plan", list(PLANS), indirect=True)
def test_work_list(list_plan):
    """Every chunk of every sequence with a query once, longest first (ties: full chunks, then
    by sequence), C a multiple of the tile, at least min_part and total / T, within the cap;
    counters zeroed whatever the buffer held."""
    ctx = [1, 37, 16, 100, 65, 0, 40]
    q_lens = [1, 1, 1, 1, 1, 1, 0]  # a padding entry (no keys) and a sequence without a query
    args, _ = paged_setup(q_lens, ctx, 4, 2, 32, 8)
    cu, lens = args[4], args[5]
    plan = pa.decode_plan(len(ctx), 2, 128, 2)
    w = DecodeWork(cu, lens, 2, plan)
    C, n = w.meta.tolist()
    total = sum(L for q, L in zip(q_lens, ctx) if q)
    assert C % plan["BN"] == 0 and C >= plan["min_part"] and C * plan["T"] >= total
    want = _expected_units(q_lens, ctx, C)
    assert n == len(want) <= w.cap == len(ctx) + plan["T"]
    got = list(zip(w.unit_seq[:n].tolist(), w.unit_c[:n].tolist()))
    assert sorted(got) == sorted((s, c) for s, c, _ in want)
    keys = {(s, c): k for s, c, k in want}
    assert all(keys[a] >= keys[b] for a, b in zip(got, got[1:]))  # longest first
    first = w.ch_first.tolist()
    chunks = [max(-(-L // C), 1) if q else 0 for q, L in zip(q_lens, ctx)]
    assert first == [sum(chunks[:s]) for s in range(len(ctx))]
    assert w.count.eq(0).all()


SHAPES = {  # name: (q_lens, ctx_lens, Hq, Hk, D, block_size)
    "gqa2": ([1] * 6, [1, 37, 16, 100, 65, 0], 4, 2, 32, 8),
    "gqa4_d64_idle": ([1, 0, 1, 1], [333, 20, 17, 3], 8, 2, 64, 16),
    "mha_one_long": ([1], [190], 2, 2, 64, 4),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("list_plan", list(PLANS), indirect=True)
def test_list_kernel_vs_twin(shape, list_plan):
    """The kernel computes the twin's function at every plan; the output is poisoned first, so
    each row with a query must be written (a padding entry's as zeros)."""
    q_lens, ctx, Hq, Hk, D, BS = SHAPES[shape]
    args, _ = paged_setup(q_lens, ctx, Hq, Hk, D, BS, seed=4)
    q, kc, vc, bt, cu, lens = args
    o = torch.full_like(q, float("nan"))
    kcv, vcv = kc.view(-1, Hk, D), vc.view(-1, Hk, D)
    strides = (q.stride(0), q.stride(1), kcv.stride(0), kcv.stride(1), bt.stride(0), o.stride(0), o.stride(1))
    pa._decode(q, kcv, vcv, bt, cu, lens, o, strides, D**-0.5 * pa._LOG2E, BS, pa.decode_plan(len(ctx), Hk, 512, 2))
    ref = pa.paged_attention_ref(*args, 1, 512, D**-0.5)
    assert not torch.isnan(o).any()
    assert rel_err(o, ref) < TOL
    if list_plan is PLANS["many"] and shape == "gqa4_d64_idle":  # the combine's second block of 16 ran
        assert -(-max(ctx) // int(DecodeWork(cu, lens, Hk, pa.decode_plan(len(ctx), Hk, 512, 2)).meta[0])) > 16


@pytest.mark.parametrize("list_plan", ["fine"], indirect=True)
def test_work_shared_by_layers_and_order_free(list_plan):
    """One work list serves every layer of a step (the last chunk to finish puts its counter back
    to 0, so the next launch combines again) with the bits of a list built by each call; a list
    of the same units in another order (so another program finishes each sequence last) gives
    the same bits: the combine runs in chunk order."""
    q_lens, ctx = [1] * 5, [70, 5, 130, 33, 64]
    Hq, Hk, D, BS = 4, 2, 32, 8
    layers = [paged_setup(q_lens, ctx, Hq, Hk, D, BS, seed=s)[0] for s in (1, 2)]
    cu, lens = layers[0][4], layers[0][5]
    work = pa.decode_work(cu, lens, Hk)
    assert work is not None and work.meta[1] > len(ctx)  # some sequences are split
    for args in layers:
        shared = pa.paged_attention(*args, 1, 256, D**-0.5, None, work)
        assert work.count.eq(0).all()
        own = pa.paged_attention(*args, 1, 256, D**-0.5)
        assert torch.equal(shared, own)
        assert rel_err(shared, pa.paged_attention_ref(*args, 1, 256, D**-0.5)) < TOL
    n = int(work.meta[1])
    work.unit_seq[:n] = work.unit_seq[:n].flip(0).clone()
    work.unit_c[:n] = work.unit_c[:n].flip(0).clone()
    assert torch.equal(pa.paged_attention(*layers[1], 1, 256, D**-0.5, None, work), own)


@pytest.mark.parametrize("list_plan", ["fine"], indirect=True)
def test_work_of_other_sizes_is_refused(list_plan):
    args, _ = paged_setup([1] * 3, [9, 20, 4], 4, 2, 32, 8)
    work = pa.decode_work(args[4][:3], args[5][:2], 2)
    with pytest.raises(ValueError, match="work list is for 2 sequences x 2 KV heads, the call has 3 x 2"):
        pa.paged_attention(*args, 1, 32, 32**-0.5, None, work)


def test_work_list_only_for_the_list_kernel(monkeypatch):
    """decode_work is built for the list kernel (the default) and is None for another plan and
    for the twin (the engine then passes nothing)."""
    cu, lens = torch.arange(4, dtype=torch.int32), torch.tensor([5, 9, 2], dtype=torch.int32)
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    assert pa.CONFIGS["decode_plan"]["kernel"] == "list" and pa.decode_work(cu, lens, 2) is not None
    monkeypatch.setitem(pa.CONFIGS, "decode_plan", {**pa.CONFIGS["decode_plan"], "kernel": "split"})
    assert pa.decode_work(cu, lens, 2) is None
    monkeypatch.setitem(pa.CONFIGS, "decode_plan", {**pa.CONFIGS["decode_plan"], "kernel": "list"})
    monkeypatch.setenv("RLCU_BACKEND", "torch")
    assert pa.decode_work(cu, lens, 2) is None
