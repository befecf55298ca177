"""Attention of new query tokens over the paged KV cache: chunked prefill and decode in one op.

The new tokens of S sequences are packed ([N, Hq, D], boundaries in `cu_seqlens_q`); their
K/V are already in the cache (`kv_write`). Sequence s has L = seq_lens[s] tokens of context,
the last q_len of which are its queries, so query j sits at position L - q_len + j and
    o = softmax(q K[0 .. pos]^T * scale) V[0 .. pos],
with K/V row p of sequence s at cache slot block_tables[s, p // BS] * BS + p % BS. Query head
h reads KV head h // G (G = Hq / Hk).

Two kernels, both launched on grids that depend only on (S, Hk, max_seqlen_q, max_seqlen_k),
never on lengths read back from the device, so a decode step can be captured in a CUDA graph
(capture with max_seqlen_k = the longest context the graph will serve):
- decode (max_seqlen_q == 1), flash-decoding, two kernels (`decode_plan` picks one; each runs
  an online softmax for the G query heads of one KV head at once, the G rows padded to 16 so
  that Q K^T and P V are tensor-core dots and each K/V tile is loaded once for all G heads;
  that loop is one function, `paged_keys.attend_keys`, which both kernels call):
  "list" (the default, `paged_decode_list.py`): a work list built once a step (chunks of a
  size chosen from the step's total keys, longest first), the split sequences combined in
  the kernel by the chunk that finishes last; see there.
  "split": program (s, KV head, split) over a
  fixed partition of max_seqlen_k (`decode_splits`); with one split a long and a short context
  are one program each, so a batch of mixed lengths ends on its longest programs.
  A sequence of several splits writes normalised partial outputs o_j and
  lse_j = m_j + log2 l_j, which the reduce kernel combines:
      o = sum_j 2^(lse_j - M) o_j / sum_j 2^(lse_j - M),   M = max_j lse_j;
  one of a single split writes o directly.
- prefill (max_seqlen_q > 1), FlashAttention-2 style: program (query tile, s, kv head) holds
  BM rows = (query token, head of the group) pairs, so the G heads of a KV head share every
  K/V tile (the engine passes the step's tile list, `prefill_tiles`: one program a tile with
  work, on a grid of a fixed size that a CUDA graph can hold); keys below the tile's first
  query position need no causal mask (first loop), the few tiles at the diagonal do (second
  loop).
Statistics are fp32 in the log2 domain (scores are multiplied by scale * log2 e, exp2 is used).

Block size: the kernels take any power-of-two block_size (a constexpr; each K/V row is
gathered through the table, so the page size does not change the memory access pattern).
DEFAULT_BLOCK_SIZE = 16: fine-grained prefix sharing between the G samples of one prompt
(a fork copies or recomputes at most 15 tokens) and little waste at the end of a sequence,
at the cost of a longer block table (256 entries for 4k tokens), which is negligible.
"""

from __future__ import annotations

import numpy as np
import torch

from rlcu.ops._backend import dispatch, tl, triton, use_triton
from rlcu.ops.paged_decode_list import DecodeWork, decode_list
from rlcu.ops.paged_keys import attend_keys, group_rows, softmax_tile

DEFAULT_BLOCK_SIZE = 16
_LOG2E = 1.4426950408889634
_DEC_MAX_SPLITS = 64
# tile sizes and launch options (bench/decode_attention.py sweeps the decode plans against the
# bandwidth bound; bench/kernel_suites/engine_ops.py --sweep times the tiles). decode: BN keys
# a tile of either decode kernel (num_stages >= 5 double-buffers the K/V tiles: the block-table
# load takes pipeline stages of its own); decode_plan: which decode kernel ("list" or "split"),
# the warps of the split kernel's reduce and an optional register cap maxnreg. prefill: BM rows
# (query token x group head), BN keys a tile.
# splits: the split kernel's policy (`decode_splits`). Measured on the H200 for the split
# kernel (B = 64, Hk = 8): at L = 512 one split (512 programs of 8 tiles, no reduce) took
# 0.094 ms and two splits (1024 programs of 4 tiles + the reduce) 0.073 ms; at L = 2048 one
# split took 0.136 ms and two 0.142 ms. So short contexts are split (per_sm programs an SM,
# min_part keys or more a split). One split a sequence suits equal lengths, but a batch of
# mixed lengths then waits on its longest programs: with contexts uniform in [200, 2048]
# (bench/decode_attention.py --splits, bench/results/decode_splits.json) one split read K/V at
# 55 / 73 / 81 / 90 / 93% of the copy bandwidth at 32 / 64 / 128 / 192 / 256 sequences and
# splits of at most max_part = 512 keys at 67 / 79 / 87 / 91 / 92% (equal lengths: 64 x 1024
# keys 93% against 86%, 256 x 512 95% against 92%; and a decode step of 64 sequences of
# 128-384 keys, bench/generate.py's fixed case, was 3.5% slower for the reduce kernel). The
# cap (max_part: past long_keys, the 1k context bucket, no split longer than max_part keys, and
# unsplit only from long_per_sm programs an SM) is not the default: on the generation protocol
# it moved the decode time by +0.6% at the 0.6B shape and -1.2% at the 8B shape (bench/
# generate.py --split-cap, same device call; the reduce kernel and the partials cost what the
# balance gains). So a batch of at least unsplit_per_sm programs an SM runs unsplit from
# unsplit_keys keys on.
# The split kernel read K/V at 91-92% of the measured copy bandwidth at 64-256 sequences of
# equal lengths (a work-list kernel that built its list in every program, since removed, at
# 71-76%; bench/results/decode_attention.json). The default is the list
# kernel: on mixed lengths (200-2048 keys) it reads K/V at 68 / 85 / 98 / 98 / 100% of copy
# bandwidth at 32 / 64 / 128 / 192 / 256 sequences against the split kernel's 54 / 73 / 79 /
# 87 / 91% (and the split cap's 66 / 78 / 86 / 89 / 91%), at equal lengths as the split kernel
# (64 x 1024: 90% against 91%; 256 x 512: 94% against 93%), its work list 3-14 us a step;
# the generation protocol +5.5% at 0.6B and +2.6% at 8B (bench/results/decode_list.json,
# generate_split_kernel.json against generate_decode_list.json, generate_8b_split_kernel.json against
# generate_8b.json). 4 units an SM, min_part 256 was the best or tied of the plans timed (the
# JSON's "w1 / w2 / w4" ran 2 / 4 / 8 units an SM).
CONFIGS = {
    "decode": dict(BN=64, num_warps=4, num_stages=3),
    "decode_plan": dict(kernel="list", reduce_warps=4),
    "prefill": dict(BM=128, BN=64, num_warps=8, num_stages=2),
    "splits": dict(per_sm=4, min_part=256, unsplit_keys=1024, unsplit_per_sm=3, long_keys=2048, long_per_sm=12,
                   max_part=None),
    # the list kernel (paged_decode_list.py; decode_plan kernel "list"): units_per_sm target
    # work units an SM, over the KV heads (its registers, 109, let 4 programs an SM run at
    # once), min_part the fewest keys a chunk
    "decode_list": dict(units_per_sm=4, min_part=256),
}


@triton.jit(do_not_specialize=["stride_bt", "PART", "NSPLIT"])
def _decode_kernel(Q, KC, VC, BLOCK_TABLES, CU_Q, SEQ_LENS, O, O_PART, LSE_PART,
                   stride_qn, stride_qh, stride_cs, stride_ch, stride_bt, stride_on, stride_oh,
                   Hq, scale_log2, PART, NSPLIT,
                   G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                   BS: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
    # NSPLIT is a runtime int and SPLIT (NSPLIT > 1) the constexpr: two compiled variants, not
    # one per split count (which changes with the batch size and the context)
    s = tl.program_id(0).to(tl.int64)
    hk = tl.program_id(1).to(tl.int64)
    j = tl.program_id(2).to(tl.int64)
    q_start = tl.load(CU_Q + s).to(tl.int64)
    q_len = tl.load(CU_Q + s + 1).to(tl.int64) - q_start
    L = tl.load(SEQ_LENS + s).to(tl.int64)
    n0 = j * PART
    if q_len == 0:
        return
    if SPLIT:
        if n0 >= L:  # an empty split: the reduce does not read it
            return
    n1 = tl.minimum(n0 + PART, L)
    g, d, gmask, dmask, h, omask = group_rows(hk, G, BG, D, BD)  # h: [BG] query heads of this KV head
    m, l, acc = attend_keys(Q, q_start, h, omask, stride_qn, stride_qh, KC, VC, BLOCK_TABLES, s,
                            stride_bt, hk, d, dmask, n0, n1, stride_cs, stride_ch, scale_log2,
                            BG=BG, BD=BD, BS=BS, BN=BN)
    l_safe = tl.where(l > 0, l, 1.0)
    out = acc / l_safe[:, None]
    if not SPLIT:
        tl.store(O + q_start * stride_on + h[:, None] * stride_oh + d[None, :],
                 out.to(O.dtype.element_ty), mask=omask)
    else:
        row = (s * Hq + h) * NSPLIT + j  # [BG] rows of the [S, Hq, NSPLIT] partials
        tl.store(O_PART + row[:, None] * D + d[None, :], out, mask=omask)
        tl.store(LSE_PART + row, m + tl.log2(l_safe), mask=gmask)


@triton.jit(do_not_specialize=["PART", "NSPLIT"])
def _decode_reduce_kernel(O_PART, LSE_PART, CU_Q, SEQ_LENS, O, stride_on, stride_oh, Hq, PART, NSPLIT,
                          D: tl.constexpr, BD: tl.constexpr, BSPLIT: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    q_start = tl.load(CU_Q + s).to(tl.int64)
    if tl.load(CU_Q + s + 1).to(tl.int64) == q_start:
        return
    L = tl.load(SEQ_LENS + s).to(tl.int64)
    j = tl.arange(0, BSPLIT)
    d = tl.arange(0, BD)
    jmask = j < (L + PART - 1) // PART  # splits that saw at least one key
    row = (s * Hq + h) * NSPLIT + j
    lse = tl.load(LSE_PART + row, mask=jmask, other=float("-inf"))
    mx = tl.max(lse, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.where(jmask, tl.exp2(lse - mx), 0.0)  # [BSPLIT]
    o = tl.load(O_PART + row[:, None] * D + d[None, :], mask=jmask[:, None] & (d < D)[None, :],
                other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(O + q_start * stride_on + h * stride_oh + d, out.to(O.dtype.element_ty), mask=d < D)


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(Q, KC, VC, BLOCK_TABLES, CU_Q, SEQ_LENS, O, TILE_SEQ, TILE_IDX,
                    stride_qn, stride_qh, stride_cs, stride_ch, stride_bt, stride_on, stride_oh,
                    scale_log2, G: tl.constexpr, BM: tl.constexpr, BMT: tl.constexpr,
                    D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                    LISTED: tl.constexpr):
    if LISTED:  # program (entry, -, kv head) of a tile list: entry -> (sequence, tile), -1 ends it
        s = tl.load(TILE_SEQ + tl.program_id(0)).to(tl.int64)
        if s < 0:
            return
        tile = tl.load(TILE_IDX + tl.program_id(0)).to(tl.int64)
    else:
        tile = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1).to(tl.int64)
    hk = tl.program_id(2).to(tl.int64)
    q_start = tl.load(CU_Q + s).to(tl.int64)
    q_len = tl.load(CU_Q + s + 1).to(tl.int64) - q_start
    L = tl.load(SEQ_LENS + s).to(tl.int64)
    t0 = tile * BMT
    if t0 >= q_len:
        return
    r = tl.arange(0, BM)
    t = t0 + r // G  # [BM] query token of each row
    h = hk * G + r % G  # [BM] query head of each row
    d = tl.arange(0, BD)
    dmask = d < D
    rmask = (r < BMT * G) & (t < q_len)
    q_off = (q_start + t)[:, None] * stride_qn + h[:, None] * stride_qh + d[None, :]
    q = tl.load(Q + q_off, mask=rmask[:, None] & dmask[None, :], other=0.0)
    q = q.to(KC.dtype.element_ty)  # [BM, BD]
    pos_q = L - q_len + t  # [BM] absolute positions
    first = L - q_len + t0
    last = tl.minimum(first + BMT - 1, L - 1)  # the last key any row of the tile may see
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    bt_row = BLOCK_TABLES + s * stride_bt
    # keys 0 .. first are visible to every row: no causal mask
    for n in range(0, ((first + 1) // BN) * BN, BN):
        pos = n + tl.arange(0, BN)
        blk = tl.load(bt_row + pos // BS).to(tl.int64)
        kv_off = (blk * BS + pos % BS)[:, None] * stride_cs + hk * stride_ch + d[None, :]
        k = tl.load(KC + kv_off, mask=dmask[None, :], other=0.0)  # [BN, BD]
        sc = tl.dot(q, tl.trans(k)) * scale_log2  # [BM, BN]
        m, l, acc = softmax_tile(m, l, acc, sc, VC, kv_off, dmask[None, :])
    # the diagonal: key p is visible to row i iff p <= pos_q[i]
    for n in range(tl.maximum(((first + 1) // BN) * BN, 0), last + 1, BN):
        pos = n + tl.arange(0, BN)
        pmask = pos <= last
        blk = tl.load(bt_row + pos // BS, mask=pmask, other=0).to(tl.int64)
        kv_off = (blk * BS + pos % BS)[:, None] * stride_cs + hk * stride_ch + d[None, :]
        kvmask = pmask[:, None] & dmask[None, :]
        k = tl.load(KC + kv_off, mask=kvmask, other=0.0)
        sc = tl.dot(q, tl.trans(k)) * scale_log2
        sc = tl.where(pmask[None, :] & (pos[None, :] <= pos_q[:, None]), sc, float("-inf"))
        m, l, acc = softmax_tile(m, l, acc, sc, VC, kv_off, kvmask)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_off = (q_start + t)[:, None] * stride_on + h[:, None] * stride_oh + d[None, :]
    tl.store(O + o_off, out.to(O.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


_NUM_SMS: dict = {}


def sm_count(device: torch.device) -> int:
    """The device's multiprocessors, which the decode plan sizes its work by (cached)."""
    if device.type != "cuda":
        return 132  # the H200 the kernels are tuned for; the interpreter only needs a number
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def decode_splits(S: int, Hk: int, max_seqlen_k: int, num_sms: int = 132, BN: int | None = None):
    """(splits, keys per split) for a decode launch (CONFIGS["splits"]): about per_sm programs
    an SM, each split at least min_part keys (a multiple of the tile); unsplit once S * Hk fills
    unsplit_per_sm programs an SM and the context reaches unsplit_keys. With a cap (max_part
    set; None by default) past long_keys (a context bucket of 4k and up) no split is longer
    than max_part keys and a batch runs unsplit only from long_per_sm programs an SM. It
    depends on sizes only, so a CUDA graph captured at max_seqlen_k serves shorter contexts."""
    cfg = CONFIGS["splits"]
    max_seqlen_k = max(int(max_seqlen_k), 1)
    BN = BN or CONFIGS["decode"]["BN"]
    long = cfg["max_part"] is not None and max_seqlen_k > cfg["long_keys"]
    if S * Hk >= cfg["long_per_sm" if long else "unsplit_per_sm"] * num_sms and max_seqlen_k >= cfg["unsplit_keys"]:
        return 1, triton.cdiv(max_seqlen_k, BN) * BN
    want = triton.cdiv(cfg["per_sm"] * num_sms, max(S * Hk, 1))
    if long:  # no split longer than max_part keys
        want = max(want, triton.cdiv(max_seqlen_k, cfg["max_part"]))
    splits = max(1, min(want, triton.cdiv(max_seqlen_k, cfg["min_part"]), _DEC_MAX_SPLITS))
    part = triton.cdiv(triton.cdiv(max_seqlen_k, splits), BN) * BN
    return triton.cdiv(max_seqlen_k, part), part


def decode_plan(S: int, Hk: int, max_seqlen_k: int, num_sms: int = 132, cfg: dict | None = None):
    """The decode launch for S sequences of up to max_seqlen_k keys (sizes only, so a CUDA graph
    captured at max_seqlen_k serves any shorter contexts): CONFIGS["decode"] (tiles) and
    CONFIGS["decode_plan"], updated by cfg, with the derived sizes filled in.
    kernel "split": the split-by-size kernel, with decode_splits' (splits, part). kernel
    "list" (paged_decode_list.py): CONFIGS["decode_list"] too, T target units (units_per_sm x
    num_sms programs over the Hk heads) and cap = S + T, the most units a step can have (so
    the grid); max_seqlen_k does not enter."""
    cfg = cfg or {}
    kernel = cfg.get("kernel", CONFIGS["decode_plan"]["kernel"])
    cfg = {**CONFIGS["decode"], **(CONFIGS["decode_list"] if kernel == "list" else {}), **CONFIGS["decode_plan"], **cfg}
    if kernel == "list":
        T = max(1, triton.cdiv(cfg["units_per_sm"] * num_sms, Hk))
        return dict(cfg, T=T, cap=max(S, 1) + T)
    if kernel != "split":
        raise ValueError(f'paged_attention: CONFIGS["decode_plan"]["kernel"] must be "list" or "split", '
                         f"got {kernel!r}")
    splits, part = decode_splits(S, Hk, max_seqlen_k, num_sms, cfg["BN"])
    return dict(cfg, splits=splits, part=part)


def _check(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens):
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_attention: q must be [N, Hq, D] and the caches [num_blocks, "
                         f"block_size, Hk, D], got {list(q.shape)}, {list(k_cache.shape)}, "
                         f"{list(v_cache.shape)}")
    N, Hq, D = q.shape
    BS, Hk = k_cache.shape[1], k_cache.shape[2]
    if k_cache.shape[3] != D or Hq % Hk:
        raise ValueError(f"paged_attention: q heads {Hq} x {D} do not fit the cache's "
                         f"{Hk} x {k_cache.shape[3]} (Hq must be a multiple of Hk)")
    S = seq_lens.shape[0]
    if cu_seqlens_q.shape != (S + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != S:
        raise ValueError(f"paged_attention: with S={S} sequences cu_seqlens_q must be [S+1] and "
                         f"block_tables [S, max_blocks], got {list(cu_seqlens_q.shape)} and "
                         f"{list(block_tables.shape)}")
    if BS & (BS - 1):
        raise ValueError(f"paged_attention: block_size must be a power of two, got {BS}")


def _decode(q, kc, vc, block_tables, cu_seqlens_q, seq_lens, o, strides, scale_log2, BS, plan, work=None):
    """Launch the decode kernels of `plan` (decode_plan's dict) writing o; kc, vc: [slots, Hk, D];
    work: the list kernel's DecodeWork of the step, or None. Returns the attention kernel's
    compiled handle (the bench reads its registers)."""
    if plan["kernel"] == "list":
        return decode_list(q, kc, vc, block_tables, cu_seqlens_q, seq_lens, o, strides, scale_log2, BS, plan, work)
    N, Hq, D = q.shape
    Hk, S = kc.shape[1], seq_lens.shape[0]
    G, BD = Hq // Hk, triton.next_power_of_2(D)
    BG = max(16, triton.next_power_of_2(G))  # tl.dot wants 16 rows or more
    common = dict(G=G, BG=BG, D=D, BD=BD, BS=BS, BN=plan["BN"],
                  num_warps=plan["num_warps"], num_stages=plan["num_stages"])
    if plan.get("maxnreg"):  # a register cap: more programs an SM
        common["maxnreg"] = plan["maxnreg"]
    splits, part = plan["splits"], plan["part"]
    if splits > 1:
        o_part = torch.empty(S, Hq, splits, D, device=q.device, dtype=torch.float32)
        lse_part = torch.empty(S, Hq, splits, device=q.device, dtype=torch.float32)
    else:
        o_part = lse_part = o  # unused
    k = _decode_kernel[(S, Hk, splits)](
        q, kc, vc, block_tables, cu_seqlens_q, seq_lens, o, o_part, lse_part, *strides,
        Hq, scale_log2, part, splits, SPLIT=splits > 1, **common)
    if splits > 1:
        _decode_reduce_kernel[(S, Hq)](
            o_part, lse_part, cu_seqlens_q, seq_lens, o, o.stride(0), o.stride(1), Hq, part, splits,
            D=D, BD=BD, BSPLIT=triton.next_power_of_2(splits),
            num_warps=plan["reduce_warps"])
    return k


def _prefill_rows(Hq: int, Hk: int) -> tuple[int, int]:
    """The prefill kernel's tile: (BM rows, BMT = BM / G query tokens). Plain Python: the
    engine builds tile lists on the host whether triton is there or not."""
    BM = max(CONFIGS["prefill"]["BM"], 1 << (Hq // Hk - 1).bit_length())
    return BM, BM // (Hq // Hk)


def prefill_tiles(q_lens, Hq: int, Hk: int, size: int | None = None, ctx_lens=None):
    """The prefill kernel's tile list of a step whose sequences take q_lens new tokens (host
    ints) -> (tile_seq, tile_idx), int32 numpy arrays: entry e is query tile tile_idx[e] of
    sequence tile_seq[e]; padded with tile_seq = -1 (an entry that exits) to `size` entries
    when given (`prefill_tiles_cap` bounds the list). With the list the grid is one program a
    tile and KV head, instead of the widest sequence's tiles times every sequence (a step of
    200 one-token decodes and one 1000-token chunk: 16 x 201 programs a KV head, 216 of them
    with work). With ctx_lens (each sequence's context, its new tokens included) the tiles
    run longest first (the keys a tile reads: its last query's position + 1), so that the
    short ones fill the last wave instead of a long one making a tail; the order changes no
    output bit (each program writes its own rows)."""
    BMT = _prefill_rows(Hq, Hk)[1]
    q = np.asarray(q_lens, dtype=np.int64)
    n = -(-q // BMT)  # tiles a sequence
    seq = np.repeat(np.arange(len(n), dtype=np.int32), n)
    idx = np.arange(len(seq), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    if ctx_lens is not None:
        ctx = np.asarray(ctx_lens, dtype=np.int64)[seq]
        keys = np.minimum(ctx - q[seq] + (idx + 1) * BMT, ctx)
        order = np.argsort(-keys, kind="stable")
        seq, idx = seq[order], idx[order]
    idx = idx.astype(np.int32)
    if size is not None:
        if size < len(seq):
            raise ValueError(f"prefill_tiles: {len(seq)} tiles do not fit a list of {size}")
        seq = np.concatenate([seq, np.full(size - len(seq), -1, dtype=np.int32)])
        idx = np.concatenate([idx, np.zeros(size - len(idx), dtype=np.int32)])
    return seq, idx


def prefill_tiles_cap(num_tokens: int, num_seqs: int, Hq: int, Hk: int) -> int:
    """The most tiles a step of num_tokens new tokens over num_seqs sequences can have (each
    sequence's last tile may be partial)."""
    return -(-num_tokens // _prefill_rows(Hq, Hk)[1]) + num_seqs


def paged_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
                           max_seqlen_q, max_seqlen_k, scale, tiles=None, work=None):
    N, Hq, D = q.shape
    BS, Hk = k_cache.shape[1], k_cache.shape[2]
    S = seq_lens.shape[0]
    G = Hq // Hk
    o = torch.empty(N, Hq, D, device=q.device, dtype=q.dtype)
    if N == 0 or S == 0:
        return o
    if q.stride(2) != 1:
        q = q.contiguous()
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention: the caches must be contiguous")
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    cu_seqlens_q, seq_lens = cu_seqlens_q.contiguous(), seq_lens.contiguous()
    BD = triton.next_power_of_2(D)
    scale_log2 = scale * _LOG2E
    kc, vc = k_cache.view(-1, Hk, D), v_cache.view(-1, Hk, D)  # [slots, Hk, D]
    strides = (q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), block_tables.stride(0),
               o.stride(0), o.stride(1))
    if max_seqlen_q <= 1:
        _decode(q, kc, vc, block_tables, cu_seqlens_q, seq_lens, o, strides, scale_log2, BS,
                decode_plan(S, Hk, max_seqlen_k, sm_count(q.device)), work)
        return o
    cfg = CONFIGS["prefill"]
    BM, BMT = _prefill_rows(Hq, Hk)
    if tiles is None:  # every (tile, sequence) of the widest sequence's tiles; the rest exit
        grid, tile_seq, tile_idx = (triton.cdiv(max_seqlen_q, BMT), S, Hk), cu_seqlens_q, cu_seqlens_q
    else:
        tile_seq, tile_idx = tiles
        grid = (tile_seq.shape[0], 1, Hk)
    _prefill_kernel[grid](
        q, kc, vc, block_tables, cu_seqlens_q, seq_lens, o, tile_seq, tile_idx, *strides, scale_log2,
        G=G, BM=BM, BMT=BMT, D=D, BD=BD, BS=BS, BN=cfg["BN"], LISTED=tiles is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return o


def paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q,
                        max_seqlen_k, scale, tiles=None, work=None):
    N, Hq, D = q.shape
    BS, Hk = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hk
    o = torch.zeros_like(q)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for s in range(len(lens)):  # a loop over sequences, not tokens
        q0, q1, L = cu[s], cu[s + 1], lens[s]
        if q1 == q0 or L == 0:
            continue
        blocks = block_tables[s, : (L + BS - 1) // BS].long()
        k = k_cache[blocks].flatten(0, 1)[:L].float()  # [L, Hk, D]
        v = v_cache[blocks].flatten(0, 1)[:L].float()
        k = k.transpose(0, 1).repeat_interleave(G, 0)  # [Hq, L, D]
        v = v.transpose(0, 1).repeat_interleave(G, 0)
        qs = q[q0:q1].float().transpose(0, 1)  # [Hq, Lq, D]
        S = qs @ k.transpose(1, 2) * scale  # [Hq, Lq, L]
        pos_q = torch.arange(L - (q1 - q0), L, device=q.device)  # absolute query positions
        mask = torch.arange(L, device=q.device)[None, :] > pos_q[:, None]
        P = torch.softmax(S.masked_fill(mask, float("-inf")), -1)
        o[q0:q1] = (P @ v).transpose(0, 1).to(q.dtype)
    return o


@dispatch(paged_attention_triton, paged_attention_ref, on="q")
def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q: int,
                    max_seqlen_k: int, scale: float, tiles=None, work=None):
    """q: [N, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hk, D]; block_tables:
    [S, max_blocks] int32; cu_seqlens_q: [S+1] int32; seq_lens: [S] int32 (context length
    including the new tokens, whose K/V are already cached); max_seqlen_q, max_seqlen_k: host
    ints bounding q_len and seq_lens (they size the launch grid) -> o [N, Hq, D] in q.dtype.
    max_seqlen_q == 1 takes the decode kernels (decode_plan). A sequence with seq_lens == 0 (a
    padding entry of a CUDA-graph batch) gets zeros; rows of q past cu_seqlens_q[-1] are
    left unwritten. tiles: None, or the prefill kernel's tile list on the device
    (`prefill_tiles`: (tile_seq, tile_idx) int32 [T], T fixed for a CUDA graph whatever the
    step's lengths); the decode kernels and the twin do not read it. work: None, or the decode
    list kernel's work list of the step (`decode_work`: built once a step for every layer; the
    kernel builds its own when None); the other kernels and the twin do not read it."""
    _check(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens)
    if tiles is not None and (len(tiles) != 2 or tiles[0].shape != tiles[1].shape or tiles[0].dim() != 1
                              or tiles[0].dtype != torch.int32 or tiles[1].dtype != torch.int32):
        raise ValueError("paged_attention: tiles must be (tile_seq, tile_idx), two int32 [T] tensors "
                         "(prefill_tiles)")


def decode_work(cu_seqlens_q, seq_lens, Hk: int):
    """The step's work list for the decode list kernel (paged_decode_list.DecodeWork), to pass
    as `work` to every layer's paged_attention of a decode step (max_seqlen_q == 1): one launch
    a step instead of one a layer. None where that kernel does not run (another decode plan, or
    the twin)."""
    if CONFIGS["decode_plan"]["kernel"] != "list" or not use_triton(seq_lens):
        return None
    plan = decode_plan(seq_lens.shape[0], Hk, 1, sm_count(seq_lens.device))
    return DecodeWork(cu_seqlens_q.contiguous(), seq_lens.contiguous(), Hk, plan)
