"""The engine's ops: KV-cache writes, paged attention (prefill chunks and split-KV decode) and
the seeded sampler. Twins are checked against independent dense / hand-written references,
kernels against the twins (on the CPU through TRITON_INTERPRET=1 at small odd shapes)."""

import math
import os
import warnings

import pytest
import torch
from support.hf_util import rel_err
from support.paged_util import paged_setup

import rlcu.ops.kv_cache as kvc
import rlcu.ops.paged_attention as pa
import rlcu.ops.sampling as smp

# conftest.py sets TRITON_INTERPRET=1 without a GPU (before triton is imported) and patches
# the interpreter for numpy >= 2.4
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("RLCU_BACKEND", "triton")
    warnings.filterwarnings("ignore", "divide by zero", RuntimeWarning)  # log(0) in the interpreter


# ------------------------------------------------------------------------------ helpers
def _dense_attention(q, dense, q_lens, ctx_lens, scale):
    """Plain causal attention on the gathered K/V of each sequence (fp64)."""
    outs, q0 = [], 0
    Hq = q.shape[1]
    for (k, v), ql, L in zip(dense, q_lens, ctx_lens):
        G = Hq // k.shape[1]
        qs = q[q0 : q0 + ql].double()
        kk, vv = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
        S = torch.einsum("qhd,khd->hqk", qs, kk) * scale
        pos = torch.arange(L - ql, L)
        S = S.masked_fill(torch.arange(L)[None, :] > pos[:, None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", S.softmax(-1), vv))
        q0 += ql
    return torch.cat(outs)


# --------------------------------------------------------------------------------- kv_write
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kv_write_round_trip(backend, monkeypatch):
    monkeypatch.setenv("RLCU_BACKEND", backend)
    N, Hq, Hk, D, BS, NB = 13, 6, 2, 24, 4, 9
    dev = DEV if backend == "triton" else "cpu"
    qkv = torch.randn(N, (Hq + 2 * Hk) * D, device=dev)  # k, v: strided views of the fused qkv
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(N, Hk, D)
    v = qkv[:, (Hq + Hk) * D :].view(N, Hk, D)
    slots = torch.randperm(NB * BS, device=dev)[:N]
    slots[[2, 7, 12]] = -1  # skipped tokens
    kc = torch.full((NB, BS, Hk, D), 7.0, device=dev)
    vc = torch.full((NB, BS, Hk, D), 7.0, device=dev)
    kvc.kv_write(k, v, kc, vc, slots)
    keep = slots >= 0
    flat_k, flat_v = kc.view(-1, Hk, D), vc.view(-1, Hk, D)
    assert torch.equal(flat_k[slots[keep]], k[keep]) and torch.equal(flat_v[slots[keep]], v[keep])
    untouched = torch.ones(NB * BS, dtype=torch.bool, device=dev)
    untouched[slots[keep]] = False
    assert bool((flat_k[untouched] == 7).all()) and bool((flat_v[untouched] == 7).all())


def test_kv_write_rejects_bad_shapes():
    with pytest.raises(ValueError, match="slot_mapping"):
        kvc.kv_write(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), torch.zeros(4, 4, 2, 8),
                     torch.zeros(4, 4, 2, 8), torch.zeros(2, dtype=torch.long))


# --------------------------------------------------------------------- paged attention twin
CASES = {  # name: (q_lens, ctx_lens, Hq, Hk, D, block_size)
    "prefill_fresh": ([5, 17], [5, 17], 4, 2, 24, 4),
    "prefill_chunks_with_context": ([7, 1, 20, 3], [30, 9, 20, 40], 6, 2, 32, 8),
    "decode": ([1, 1, 1, 1], [1, 16, 37, 100], 6, 3, 24, 16),
    "decode_mha": ([1, 1], [70, 5], 4, 4, 32, 16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_twin_vs_dense(case):
    q_lens, ctx, Hq, Hk, D, BS = CASES[case]
    args, dense = paged_setup(q_lens, ctx, Hq, Hk, D, BS, device="cpu")
    scale = D**-0.5
    o = pa.paged_attention(*args, max(q_lens), max(ctx), scale)
    ref = _dense_attention(args[0], dense, q_lens, ctx, scale)
    assert rel_err(o, ref) < 1e-6


KERNEL_CASES = {  # name: (q_lens, ctx_lens, Hq, Hk, D, block_size, max_seqlen_k passed)
    # two query tiles for one sequence (BM=128 rows / G=3 -> 42 tokens a tile), earlier context
    "prefill": ([50, 1, 9], [70, 33, 9], 6, 2, 24, 16, None),
    "prefill_odd_D": ([4, 12], [20, 12], 4, 2, 20, 4, None),
    "decode_one_split": ([1, 1, 1], [3, 64, 200], 4, 2, 32, 16, None),
    "decode_splits": ([1, 1], [700, 90], 4, 2, 24, 16, None),  # 3 splits of 256 keys
    "decode_graph_bound": ([1, 1, 1], [300, 1, 45], 4, 1, 32, 8, 1024),  # grid sized for 1024
    "decode_padded": ([1, 1, 1], [50, 0, 7], 4, 2, 16, 8, 600),  # an empty padding entry
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_paged_attention_kernel_vs_twin(case, triton_backend):
    q_lens, ctx, Hq, Hk, D, BS, max_k = KERNEL_CASES[case]
    args, _ = paged_setup(q_lens, ctx, Hq, Hk, D, BS, seed=1)
    scale = D**-0.5
    max_k = max_k or max(ctx)
    if case == "decode_splits":
        assert pa.decode_splits(len(q_lens), Hk, max_k)[0] == 3
    o = pa.paged_attention(*args, max(q_lens), max_k, scale)
    ref = pa.paged_attention_ref(*args, max(q_lens), max_k, scale)
    assert o.shape == ref.shape and o.dtype == ref.dtype
    assert rel_err(o, ref) < (1e-5 if INTERPRET else 3e-3)  # fp32 dots are tf32 on a GPU


def test_prefill_tile_list_launch_equals_the_grid(triton_backend):
    """The engine's prefill launch by a tile list (one program a tile with work, padded with
    entries that exit, as a CUDA graph holds it) writes what the grid launch does, bit for bit:
    a mixed step of decodes, a chunk of two tiles after context, and a sequence taking no
    tokens this step."""
    q_lens, ctx, Hq, Hk, D, BS = [1, 50, 0, 9, 1], [40, 70, 12, 9, 3], 6, 2, 24, 16
    args, _ = paged_setup(q_lens, ctx, Hq, Hk, D, BS, seed=3)
    scale = D**-0.5
    cap = pa.prefill_tiles_cap(sum(q_lens), len(q_lens), Hq, Hk)
    seq, idx = pa.prefill_tiles(q_lens, Hq, Hk, size=cap + 3)
    assert seq.tolist() == [0, 1, 1, 3, 4] + [-1] * (cap - 2) and idx.tolist()[:5] == [0, 0, 1, 0, 0]
    # longest first, by the keys each tile reads (42 tokens a tile): 70 and 62 (sequence 1), 40, 9, 3
    lpt = pa.prefill_tiles(q_lens, Hq, Hk, size=cap + 3, ctx_lens=ctx)
    assert list(zip(*(a.tolist()[:5] for a in lpt))) == [(1, 1), (1, 0), (0, 0), (3, 0), (4, 0)]
    grid = pa.paged_attention(*args, max(q_lens), max(ctx), scale)
    for s, i in ((seq, idx), lpt):
        tiles = (torch.from_numpy(s).to(DEV), torch.from_numpy(i).to(DEV))
        listed = pa.paged_attention(*args, max(q_lens), max(ctx), scale, tiles)
        assert torch.equal(listed, grid)
    assert rel_err(listed, pa.paged_attention_ref(*args, max(q_lens), max(ctx), scale)) < (1e-5 if INTERPRET else 3e-3)
    with pytest.raises(ValueError, match="do not fit"):
        pa.prefill_tiles(q_lens, Hq, Hk, size=4)
    with pytest.raises(ValueError, match="tiles must be"):
        pa.paged_attention(*args, max(q_lens), max(ctx), scale, (tiles[0].long(), tiles[1]))


DECODE_PLANS = {  # name: cfg overrides of decode_plan (tiny tiles so that contexts span many)
    "split": dict(kernel="split", BN=16),
    "split_one_reduce_warp": dict(kernel="split", BN=16, reduce_warps=1),
    "list": dict(kernel="list", BN=16),
}
DECODE_SHAPES = {  # name: (ctx_lens, Hq, Hk, D, block_size, max_seqlen_k passed)
    "gqa2_d128": ([1, 37, 16, 100, 65], 4, 2, 128, 16, None),
    "gqa4_d64_odd": ([333, 17, 3], 8, 2, 64, 8, 1024),
    "mha_b1": ([190], 2, 2, 64, 4, None),
    "padding_entry": ([50, 0, 7], 4, 2, 32, 8, 600),
}


@pytest.mark.parametrize("plan", list(DECODE_PLANS))
@pytest.mark.parametrize("shape", list(DECODE_SHAPES))
def test_decode_plans_vs_twin(plan, shape, triton_backend, monkeypatch):
    """Every decode kernel and work split the bench sweeps computes the twin's function; the
    output is poisoned first, so every row must be written."""
    ctx, Hq, Hk, D, BS, max_k = DECODE_SHAPES[shape]
    args, _ = paged_setup([1] * len(ctx), ctx, Hq, Hk, D, BS, seed=2)
    max_k = max_k or max(ctx)
    monkeypatch.setitem(pa.CONFIGS, "decode_plan", {**pa.CONFIGS["decode_plan"],
                                                    **DECODE_PLANS[plan]})
    q, kc, vc, bt, cu, lens = args
    o = torch.full_like(q, float("nan"))
    kcv, vcv = kc.view(-1, Hk, D), vc.view(-1, Hk, D)
    strides = (q.stride(0), q.stride(1), kcv.stride(0), kcv.stride(1), bt.stride(0), o.stride(0),
               o.stride(1))
    pa._decode(q, kcv, vcv, bt, cu, lens, o, strides, D**-0.5 * pa._LOG2E, BS,
               pa.decode_plan(len(ctx), Hk, max_k, 2))
    ref = pa.paged_attention_ref(*args, 1, max_k, D**-0.5)
    assert not torch.isnan(o).any()  # a padding entry (length 0) gets zeros, as in the twin
    assert rel_err(o, ref) < (1e-5 if INTERPRET else 3e-3)
    assert rel_err(pa.paged_attention(*args, 1, max_k, D**-0.5), ref) < (1e-5 if INTERPRET else 3e-3)


def test_decode_plan_sizes_only():
    """The plan (so the grid) follows sizes, never lengths: the list kernel's grid follows the
    batch only, the split kernel's the batch and the context bucket; another kernel name is
    refused, naming the field."""
    p = pa.decode_plan(256, 8, 4096, 132, dict(kernel="list", units_per_sm=4))
    assert (p["T"], p["cap"]) == (66, 256 + 66)
    assert pa.decode_plan(256, 8, 1 << 20, 132, dict(kernel="list"))["cap"] == p["cap"]
    p = pa.decode_plan(1, 8, 4096, 132, dict(kernel="split"))
    assert p["splits"] * p["part"] >= 4096 and p["part"] % p["BN"] == 0
    with pytest.raises(ValueError, match="decode_plan.*kernel.*'chunk'"):
        pa.decode_plan(1, 8, 4096, 132, dict(kernel="chunk"))


def test_decode_splits_fill_the_machine():
    for S in (1, 8, 64, 256):
        splits, part = pa.decode_splits(S, 8, 4096, 132)
        assert splits * part >= 4096 and part % 64 == 0
        assert S * 8 * splits >= min(3 * 132, S * 8 * (4096 // 256))  # SMs filled
    assert pa.decode_splits(256, 8, 4096, 132)[0] == 1


def test_decode_splits_cap_the_keys_of_a_split(monkeypatch):
    """Past long_keys (4k context buckets and up) no split is longer than max_part keys below
    long_per_sm programs an SM (a batch of mixed lengths would wait on its longest programs);
    wider batches run unsplit, and so do batches of unsplit_per_sm programs an SM in the 1k
    bucket (short contexts: the reduce would cost more than the balance gains). The cap is
    bench/generate.py --split-cap's, not the default."""
    assert pa.CONFIGS["splits"]["max_part"] is None
    assert pa.decode_splits(64, 8, 4096, 132) == (1, 4096)  # the default: unsplit from 3 programs an SM
    cfg = dict(pa.CONFIGS["splits"], max_part=512)
    monkeypatch.setitem(pa.CONFIGS, "splits", cfg)
    lo = -(-cfg["long_per_sm"] * 132 // 8)  # sequences at 8 KV heads
    for S in (1, 16, 64, 128, lo - 1):
        for kb in (4096, 16384, 40960):
            splits, part = pa.decode_splits(S, 8, kb, 132)
            assert splits * part >= kb and part % 64 == 0
            assert part <= max(cfg["max_part"], -(-kb // pa._DEC_MAX_SPLITS // 64) * 64)
    assert pa.decode_splits(64, 8, 4096, 132) == (8, 512)
    assert pa.decode_splits(64, 8, 1024, 132) == (1, 1024) and pa.decode_splits(48, 8, 1024, 132)[0] == 2
    assert pa.decode_splits(lo, 8, 4096, 132)[0] == pa.decode_splits(256, 8, 40960, 132)[0] == 1
    assert pa.decode_splits(8, 8, 512, 132) == (2, 256)  # a split has min_part keys or more


# ------------------------------------------------------------------------------ sampling
def _params(B, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed0=0, offset=0):
    return (torch.full((B,), float(temperature)), torch.full((B,), top_k, dtype=torch.int32),
            torch.full((B,), float(top_p)), torch.full((B,), float(min_p)),
            torch.arange(B, dtype=torch.int64) + seed0, torch.full((B,), offset, dtype=torch.int64))


def _kept_by_hand(logits, T, top_k, top_p, min_p):
    """The kept set of one row, written out with Python floats (min-p, top-k, top-p)."""
    z = [float(x) / T for x in logits]
    V = len(z)
    m = max(z)
    keep = [zi >= m + (math.log(min_p) if min_p > 0 else -math.inf) for zi in z]
    if 0 < top_k < V:
        kth = sorted(z, reverse=True)[top_k - 1]
        keep = [kp and zi >= kth for kp, zi in zip(keep, z)]
    if top_p < 1:
        p = [math.exp(zi - m) if kp else 0.0 for zi, kp in zip(z, keep)]
        tot = sum(p)
        keep = [kp and sum(pj for zj, pj in zip(z, p) if zj > zi) < top_p * tot
                for kp, zi in zip(keep, z)]
    return {i for i in range(V) if keep[i]}


ROW = torch.tensor([1.3, -0.2, 2.1, 0.4, 2.1, -1.5, 0.9])  # V = 7, a tie at the top
FILTERS = {  # name: (T, top_k, top_p, min_p)
    "plain": (1.0, 0, 1.0, 0.0),
    "hot": (1.7, 0, 1.0, 0.0),
    "top_k3": (1.0, 3, 1.0, 0.0),
    "top_k2_tie": (0.8, 2, 1.0, 0.0),
    "top_k1": (1.0, 1, 1.0, 0.0),  # the tied maximum: both kept
    "top_p": (1.0, 0, 0.7, 0.0),
    "top_p_tiny": (1.0, 0, 0.05, 0.0),
    "min_p": (1.0, 0, 1.0, 0.3),
    "all": (0.9, 5, 0.8, 0.1),
}


def test_sample_greedy_is_argmax():
    logits = torch.randn(9, 333)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first index wins
    toks, lps = smp.sample(logits, *_params(9, temperature=0.0))
    assert torch.equal(toks, logits.argmax(-1)) and int(toks[3]) == 10
    assert torch.allclose(lps, torch.log_softmax(logits, -1).gather(1, toks[:, None])[:, 0])
    assert torch.equal(smp.greedy(logits), toks)


@pytest.mark.parametrize("name", list(FILTERS))
def test_sample_twin_kept_set_and_frequencies(name):
    T, k, p, mp = FILTERS[name]
    kept = _kept_by_hand(ROW.tolist(), T, k, p, mp)
    n = 4000
    logits = ROW.expand(n, -1).contiguous()
    toks, lps = smp.sample(logits, *_params(n, T, k, p, mp, seed0=12345))
    seen = set(toks.tolist())
    assert seen == kept, (seen, kept)  # nothing outside the set, every member drawn
    z = ROW / T
    assert torch.allclose(lps, torch.log_softmax(z, -1)[toks], atol=0, rtol=1e-6)
    probs = torch.zeros(7)
    idx = torch.tensor(sorted(kept))
    probs[idx] = torch.softmax(z[idx], -1)
    counts = torch.bincount(toks, minlength=7).double()
    chi2 = float(((counts[idx] - n * probs[idx]) ** 2 / (n * probs[idx])).sum())
    dof = max(len(kept) - 1, 1)
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 6, (chi2, counts.tolist(), probs.tolist())


def test_sample_reproducible_and_batch_independent():
    torch.manual_seed(0)
    B, V = 12, 333
    logits = torch.randn(B, V) * 2
    params = _params(B, 0.8, 50, 0.9, 0.0, seed0=77, offset=5)
    a, la = smp.sample(logits, *params)
    b, lb = smp.sample(logits, *params)
    assert torch.equal(a, b) and torch.equal(la, lb)
    perm = torch.randperm(B)  # the same rows in another order, and one alone
    c, _ = smp.sample(logits[perm], *(t[perm] for t in params))
    assert torch.equal(c, a[perm])
    d, _ = smp.sample(logits[4:5], *(t[4:5] for t in params))
    assert int(d) == int(a[4])
    T, k, p, mp, seeds, offs = params
    e, _ = smp.sample(logits, T, k, p, mp, seeds, offs + 1)  # the next step draws anew
    assert not torch.equal(e, a)


def test_hash_rng_is_uniform_and_matches_uint32():
    key = smp._row_key_ref(torch.tensor([3, -1, 2**40]), torch.tensor([0, 7, 2**33]))
    assert int(key.min()) >= 0 and int(key.max()) < 2**32
    x = torch.tensor([0, 1, 12345, 2**32 - 1])
    # lowbias32 in plain Python integers
    def h(v):
        v ^= v >> 16
        v = (v * 0x7FEB352D) & 0xFFFFFFFF
        v ^= v >> 15
        v = (v * 0x846CA68B) & 0xFFFFFFFF
        return v ^ (v >> 16)
    assert smp._hash32_ref(x).tolist() == [h(int(v)) for v in x]
    g = smp._gumbel_ref(key[:1], 20000)[0]
    assert abs(float(g.mean()) - 0.5772) < 0.03 and abs(float(g.var()) - math.pi**2 / 6) < 0.1


SAMPLE_KERNEL_CASES = {  # name: per-row (T, top_k, top_p, min_p)
    "mixed": [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 0, 0.8, 0.0), (1.0, 20, 0.9, 0.0),
              (0.5, 0, 1.0, 0.1), (1.3, 5, 0.7, 0.05), (1.0, 1, 1.0, 0.0), (1.0, 333, 1.0, 0.0)],
}


@pytest.mark.parametrize("kind", ["fp32", "bf16", "clustered", "masked"])
def test_sample_kernel_vs_twin(kind, triton_backend):
    rows = SAMPLE_KERNEL_CASES["mixed"]
    B, V = len(rows), 333
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, V, generator=g) * 3
    if kind == "bf16":  # many exact ties
        logits = logits.bfloat16()
    if kind == "clustered":  # thresholds between values a few ulps apart: every search pass
        logits = 5.0 + logits * 1e-5
    if kind == "masked":  # -inf logits (a masked vocabulary)
        logits[:, 200:] = float("-inf")
        logits[:, 50:60] = float("-inf")
    logits[6, 100] = logits[6, 200] = logits[6].max()  # top-1 with a tie: either is kept
    params = (torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows],
              dtype=torch.int32), torch.tensor([r[2] for r in rows]),
              torch.tensor([r[3] for r in rows]), torch.arange(B) * 31 + 5, torch.arange(B))
    params = tuple(t.to(DEV) for t in params)
    logits = logits.to(DEV)
    toks, lps = smp.sample(logits, *params)
    rtoks, rlps = smp.sample_ref(logits, *params)
    assert toks.dtype == torch.int64 and lps.dtype == torch.float32
    assert torch.equal(toks, rtoks)
    assert torch.allclose(lps, rlps, atol=1e-5, rtol=1e-5)


def test_sample_kernel_split_rows(triton_backend, monkeypatch):
    """Rows cut into many pass-1 chunks (128 tokens), search chunks (64) and tiles (16): the
    tile bounds of top-k and top-p, the skipping of tiles and the chunked race are exercised."""
    monkeypatch.setitem(smp.CONFIGS, "pass1", dict(BV=64, CHUNK=128, num_warps=4))
    monkeypatch.setitem(smp.CONFIGS, "row", dict(BT=16, CHUNK=64, num_warps=4))
    rows = SAMPLE_KERNEL_CASES["mixed"] + [(1.0, 0, 0.95, 0.0), (0.8, 7, 1.0, 0.0), (1.0, 0, 0.5, 0.02)]
    B, V = len(rows), 333
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(B, V, generator=g) * 3
    logits[1::2] = logits[1::2].bfloat16().float()  # ties
    logits[3, 100:] = float("-inf")
    params = (torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows],
              dtype=torch.int32), torch.tensor([r[2] for r in rows]),
              torch.tensor([r[3] for r in rows]), torch.arange(B) * 17 + 3, torch.arange(B) + 2)
    toks, lps = smp.sample(logits.to(DEV), *(t.to(DEV) for t in params))
    rtoks, rlps = smp.sample_ref(logits, *params)
    assert torch.equal(toks.cpu(), rtoks)
    assert torch.allclose(lps.cpu(), rlps, atol=1e-5, rtol=1e-5)


def test_sample_kernel_kept_set(triton_backend):
    """Many seeds of one filtered row through the kernel: exactly the hand-computed set."""
    T, k, p, mp = FILTERS["all"]
    kept = _kept_by_hand(ROW.tolist(), T, k, p, mp)
    n = 16
    toks, _ = smp.sample(ROW.expand(n, -1).contiguous().to(DEV), *(t.to(DEV) for t in
                         _params(n, T, k, p, mp, seed0=99)))
    ref, _ = smp.sample_ref(ROW.expand(n, -1).contiguous(), *_params(n, T, k, p, mp, seed0=99))
    assert set(toks.tolist()) <= kept and torch.equal(toks.cpu(), ref)


# --------------------------------------------------------------------------- GPU, bf16
@pytest.mark.gpu
@pytest.mark.parametrize("BS", [16, 256])
def test_gpu_paged_attention_qwen3_shapes(BS):
    Hq, Hk, D = 16, 8, 128
    torch.manual_seed(0)
    # decode, batch 256, contexts up to 4k
    ctx = torch.randint(1, 4097, (256,)).tolist()
    args, _ = paged_setup([1] * 256, ctx, Hq, Hk, D, BS, dtype=torch.bfloat16, device="cuda")
    o = pa.paged_attention(*args, 1, 4096, D**-0.5)
    ref = pa.paged_attention_ref(*args, 1, 4096, D**-0.5)
    assert rel_err(o, ref) < 1e-2
    # chunked prefill over cached context (a prefix hit) plus some decode rows
    q_lens, ctx = [512, 1000, 1, 1, 37], [2048, 1000, 4096, 300, 3000]
    args, _ = paged_setup(q_lens, ctx, Hq, Hk, D, BS, dtype=torch.bfloat16, device="cuda")
    o = pa.paged_attention(*args, max(q_lens), max(ctx), D**-0.5)
    ref = pa.paged_attention_ref(*args, max(q_lens), max(ctx), D**-0.5)
    assert rel_err(o, ref) < 1e-2


@pytest.mark.gpu
def test_gpu_kv_write_bf16():
    N, Hk, D, BS, NB = 300, 8, 128, 16, 64
    qkv = torch.randn(N, 32 * D, device="cuda", dtype=torch.bfloat16)
    k, v = qkv[:, 16 * D : 24 * D].view(N, Hk, D), qkv[:, 24 * D :].view(N, Hk, D)
    slots = torch.randperm(NB * BS, device="cuda")[:N]
    slots[::7] = -1
    kc = torch.zeros(NB, BS, Hk, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    kc2, vc2 = kc.clone(), vc.clone()
    kvc.kv_write(k, v, kc, vc, slots)
    kvc.kv_write_ref(k, v, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_sample_qwen3_vocab(dtype):
    B, V = 256, 151936
    torch.manual_seed(0)
    logits = (torch.randn(B, V, device="cuda") * 4).to(dtype)
    T = torch.rand(B, device="cuda") + 0.3
    T[:16] = 0
    top_k = torch.where(torch.rand(B, device="cuda") < 0.3, 50, 0).int()
    top_p = torch.where(torch.rand(B, device="cuda") < 0.3, 0.9, 1.0)
    min_p = torch.where(torch.rand(B, device="cuda") < 0.2, 0.05, 0.0)
    seeds = torch.randint(0, 2**62, (B,), device="cuda")
    offs = torch.randint(0, 4096, (B,), device="cuda")
    toks, lps = smp.sample(logits, T, top_k, top_p, min_p, seeds, offs)
    rtoks, rlps = smp.sample_ref(logits, T, top_k, top_p, min_p, seeds, offs)
    # the kernel's outer log of the noise is lg2.approx (~1e-6): a near-tie may differ
    assert int((toks != rtoks).sum()) <= 1
    ref_lp = torch.log_softmax(logits.float() / torch.where(T > 0, T, 1)[:, None], -1)
    assert torch.allclose(lps, ref_lp.gather(1, toks[:, None])[:, 0], atol=2e-5, rtol=1e-5)
    again, _ = smp.sample(logits[100:101], T[100:101], top_k[100:101], top_p[100:101],
                          min_p[100:101], seeds[100:101], offs[100:101])
    assert int(again) == int(toks[100])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_sample_filters(dtype):
    """Filtered rows of three kinds: the benchmark's (top-k 50 + top-p 0.9: a few tiles a
    row), top-p alone on flat logits (every tile of the row is read), a few strong tokens over
    a long tail (top-p, top-k + top-p, min-p)."""
    V, n = 151936, 32
    torch.manual_seed(1)
    llm = torch.randn(n, V, device="cuda") * 1.5
    llm[:, torch.randperm(V, device="cuda")[:2000]] += 6
    logits = torch.cat([torch.randn(n, V, device="cuda") * 3, torch.randn(n, V, device="cuda"),
                        llm]).to(dtype)
    B = 3 * n

    def col(*parts):
        return torch.tensor([v for v, m in parts for _ in range(m)], device="cuda")

    T = col((0.7, n), (1.0, 2 * n)).float()
    top_k = col((50, n), (0, n + n // 2), (50, n // 2)).int()
    top_p = col((0.9, n), (0.95, n + n // 2), (0.9, n // 4), (1.0, n // 4)).float()
    min_p = col((0.0, 2 * n + n // 2), (0.05, n // 2)).float()
    seeds = torch.randint(0, 2**62, (B,), device="cuda")
    offs = torch.randint(0, 4096, (B,), device="cuda")
    toks, lps = smp.sample(logits, T, top_k, top_p, min_p, seeds, offs)
    rtoks, _ = smp.sample_ref(logits, T, top_k, top_p, min_p, seeds, offs)
    # the kernel's outer log of the noise is lg2.approx (~1e-6): a near-tie may differ
    assert int((toks != rtoks).sum()) <= 1
    ref_lp = torch.log_softmax(logits.float() / T[:, None], -1)
    assert torch.allclose(lps, ref_lp.gather(1, toks[:, None])[:, 0], atol=2e-5, rtol=1e-5)
    again, _ = smp.sample(logits, T, top_k, top_p, min_p, seeds, offs)
    assert torch.equal(again, toks)  # deterministic
