"""The balanced decode kernel of paged attention (paged_attention.decode_plan's kernel "list", the
default): a work list built once a step on the device, longest units first, and the split
sequences' partials combined inside the attention kernel by the program that finishes last.
bench/decode_attention.py --list measures it against the split kernel on sequences of mixed
lengths (bench/results/decode_list.json).

Why: with one program a (sequence, KV head), a batch of mixed lengths ends on its longest
programs (bench/results/decode_splits.json); splitting every sequence finely balances it but
adds a reduce kernel a layer, which cost what the balance gained on the protocol. Here:

- `_decode_work_kernel` (one program, once a step: the lengths are the same in every layer)
  picks the chunk size C = max(min_part, ceil(total keys / T)) rounded up to the tile, T the
  target units (`units_per_sm` programs an SM, over the KV heads), and cuts
  sequence s into n_s = max(ceil(L_s / C), 1) chunks. Unit (s, c) is keys c C .. min((c + 1) C,
  L_s) - 1. The list runs longest first (all full chunks, then each sequence's last chunk by
  its length, descending; ties by sequence), so the block scheduler hands the short units to
  the slots that free up first (longest-processing-time order). It also zeroes the arrival
  counters and writes (C, units). The list has at most S + T units: sum_s n_s <= S + total / C.
- `_decode_list_kernel`, program p = (unit p // Hk, KV head p % Hk) on a grid of (S + T) Hk
  programs (sizes only, so a CUDA graph holds it; programs past the step's units exit). A
  sequence of one chunk writes o. A chunk of a split sequence writes its normalised partial
  (o_j, lse_j = m_j + log2 l_j), then adds one to its (sequence, KV head)'s counter; the program
  that brings it to n_s (the last to finish) combines the n_s partials in chunk order,
      o = sum_j 2^(lse_j - M) o_j / sum_j 2^(lse_j - M)  (paged_keys.combine_chunks, 16 at a time),
  writes o and puts the counter back to 0 for the next layer. The order of the sum is fixed,
  so the bits do not depend on which program finished last. The partials are stored before a
  CTA barrier and an acq_rel atomic (the release of every thread's stores), and read after it
  through L2 (`.cg`), as a semaphore of CUDA's memory model wants.

Chunks of a sequence are numbered sequence-major (CH_FIRST[s] + c), whatever their place in the
list, so the combine finds them. A unit's keys go through paged_keys.attend_keys, as in the
other decode kernels.
"""

from __future__ import annotations

import torch

from rlcu.ops._backend import tl, triton
from rlcu.ops.paged_keys import attend_keys, combine_chunks, group_rows


@triton.jit(do_not_specialize=["S", "T"])
def _decode_work_kernel(CU_Q, SEQ_LENS, UNIT_SEQ, UNIT_C, CH_FIRST, COUNT, META, S, T,
                        Hk: tl.constexpr, BHK: tl.constexpr, MIN_PART: tl.constexpr, BN: tl.constexpr,
                        BSEQ: tl.constexpr, BJ: tl.constexpr):
    i = tl.arange(0, BSEQ)
    imask = i < S
    qlen = tl.load(CU_Q + i + 1, mask=imask, other=0) - tl.load(CU_Q + i, mask=imask, other=0)
    lens = tl.load(SEQ_LENS + i, mask=imask, other=0)
    active = imask & (qlen > 0)  # a sequence with no query takes no unit
    total = tl.sum(tl.where(active, lens, 0), 0)
    C = tl.maximum(MIN_PART, ((total + T - 1) // T + BN - 1) // BN * BN)
    # an empty context (a graph's padding entry) takes one unit of no keys: its o is zeros
    nch = tl.where(active, tl.maximum((lens + C - 1) // C, 1), 0)
    tl.store(CH_FIRST + i, tl.cumsum(nch, 0) - nch, mask=imask)
    nfull = tl.maximum(nch - 1, 0)  # chunks of C keys before each sequence's last
    ffirst = tl.cumsum(nfull, 0) - nfull
    F = tl.sum(nfull, 0)
    for c in range(0, tl.max(nfull, 0)):  # the full chunks first, sequence-major
        fm = c < nfull
        tl.store(UNIT_SEQ + ffirst + c, i, mask=fm)
        tl.store(UNIT_C + ffirst + c, tl.zeros_like(i) + c, mask=fm)
    # then the last chunks, longest first: rank = the active sequences whose last chunk is
    # longer, or as long and earlier
    rem = tl.where(active, lens - nfull * C, -1)
    rank = tl.zeros([BSEQ], tl.int32)
    for j0 in range(0, S, BJ):
        j = j0 + tl.arange(0, BJ)
        jmask = j < S
        qj = tl.load(CU_Q + j + 1, mask=jmask, other=0) - tl.load(CU_Q + j, mask=jmask, other=0)
        lj = tl.load(SEQ_LENS + j, mask=jmask, other=0)
        nj = tl.maximum((lj + C - 1) // C, 1)
        rj = tl.where(jmask & (qj > 0), lj - (nj - 1) * C, -1)  # [BJ]
        before = (rj[None, :] > rem[:, None]) | ((rj[None, :] == rem[:, None]) & (j[None, :] < i[:, None]))
        rank += tl.sum(before.to(tl.int32), 1)
    tl.store(UNIT_SEQ + F + rank, i, mask=active)
    tl.store(UNIT_C + F + rank, nch - 1, mask=active)
    hk = tl.arange(0, BHK)
    tl.store(COUNT + i[:, None] * Hk + hk[None, :], tl.zeros([BSEQ, BHK], tl.int32),
             mask=imask[:, None] & (hk < Hk)[None, :])
    tl.store(META, C)
    tl.store(META + 1, tl.sum(nch, 0))


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_list_kernel(Q, KC, VC, BLOCK_TABLES, CU_Q, SEQ_LENS, O, O_PART, LSE_PART, UNIT_SEQ, UNIT_C,
                        CH_FIRST, COUNT, META, stride_qn, stride_qh, stride_cs, stride_ch, stride_bt,
                        stride_on, stride_oh, Hq, scale_log2, Hk: tl.constexpr, G: tl.constexpr,
                        BG: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr,
                        BN: tl.constexpr, BJ: tl.constexpr):
    p = tl.program_id(0)
    u = p // Hk
    if u >= tl.load(META + 1):
        return
    hk = (p % Hk).to(tl.int64)
    C = tl.load(META)
    s = tl.load(UNIT_SEQ + u).to(tl.int64)
    c = tl.load(UNIT_C + u)
    q_start = tl.load(CU_Q + s).to(tl.int64)
    L = tl.load(SEQ_LENS + s)
    n_s = tl.maximum((L + C - 1) // C, 1)
    n0 = c * C
    n1 = tl.minimum(n0 + C, L)
    g, d, gmask, dmask, h, omask = group_rows(hk, G, BG, D, BD)  # h: [BG] query heads of this KV head
    m, l, acc = attend_keys(Q, q_start, h, omask, stride_qn, stride_qh, KC, VC, BLOCK_TABLES, s,
                            stride_bt, hk, d, dmask, n0, n1, stride_cs, stride_ch, scale_log2,
                            BG=BG, BD=BD, BS=BS, BN=BN)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_ptr = O + q_start * stride_on + h[:, None] * stride_oh + d[None, :]
    if n_s == 1:  # the whole context in one chunk: no combine
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=omask)
    else:
        first = tl.load(CH_FIRST + s).to(tl.int64)
        row = (first + c) * Hq + h  # [BG] rows of the [chunks, Hq] partials
        tl.store(O_PART + row[:, None] * D + d[None, :], out, mask=omask)
        tl.store(LSE_PART + row, m + tl.log2(l), mask=gmask)  # l >= 1: every chunk has keys
        tl.debug_barrier()  # every thread's partial stored before the release
        arrived = tl.atomic_add(COUNT + s * Hk + hk, 1, sem="acq_rel", scope="gpu")
        if arrived == n_s - 1:  # the last chunk of (s, hk) to finish: the combine, in chunk order
            tl.debug_barrier()
            for gi in tl.static_range(G):  # each query head's partials, through L2 (other programs wrote them)
                o_h = combine_chunks(O_PART, LSE_PART, first, n_s, hk * G + gi, Hq, d, dmask, D, BD, BJ)
                tl.store(O + q_start * stride_on + (hk * G + gi) * stride_oh + d, o_h.to(O.dtype.element_ty),
                         mask=dmask)
            tl.store(COUNT + s * Hk + hk, 0)  # ready for the next layer's launch


class DecodeWork:
    """A step's work list (`_decode_work_kernel`'s outputs, on the device): built once a step
    for every layer's launch (paged_attention's `work`). plan: decode_plan's dict of kernel
    "list" (T target units, cap units at most; min_part, BN). The grid is cap x Hk programs."""

    def __init__(self, cu_q: torch.Tensor, seq_lens: torch.Tensor, Hk: int, plan: dict):
        S, dev = seq_lens.shape[0], seq_lens.device
        T, cap = plan["T"], plan["cap"]
        self.S, self.Hk, self.cap = S, Hk, cap
        i32 = dict(device=dev, dtype=torch.int32)
        self.unit_seq, self.unit_c = torch.empty(cap, **i32), torch.empty(cap, **i32)
        self.ch_first, self.count = torch.empty(max(S, 1), **i32), torch.empty(max(S, 1) * Hk, **i32)
        self.meta = torch.empty(2, **i32)  # (C, units)
        _decode_work_kernel[(1,)](
            cu_q, seq_lens, self.unit_seq, self.unit_c, self.ch_first, self.count, self.meta, S, T, Hk=Hk,
            BHK=triton.next_power_of_2(Hk), MIN_PART=plan["min_part"], BN=plan["BN"],
            BSEQ=max(16, triton.next_power_of_2(S)), BJ=16)

    def matches(self, S: int, Hk: int) -> bool:
        return S == self.S and Hk == self.Hk


def decode_list(q, kc, vc, block_tables, cu_q, seq_lens, o, strides, scale_log2, BS, plan, work=None):
    """Launch the list kernel of `plan` (decode_plan's dict) writing o, building the work list
    first unless `work` (a DecodeWork of the same sizes) is given. Returns the attention
    kernel's compiled handle."""
    N, Hq, D = q.shape
    Hk, S = kc.shape[1], seq_lens.shape[0]
    if work is None:
        work = DecodeWork(cu_q, seq_lens, Hk, plan)
    elif not work.matches(S, Hk):
        raise ValueError(f"paged_attention: the decode work list is for {work.S} sequences x {work.Hk} KV heads, "
                         f"the call has {S} x {Hk}")
    G, BD = Hq // Hk, triton.next_power_of_2(D)
    o_part = torch.empty(work.cap, Hq, D, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(work.cap, Hq, device=q.device, dtype=torch.float32)
    extra = {"maxnreg": plan["maxnreg"]} if plan.get("maxnreg") else {}
    return _decode_list_kernel[(work.cap * Hk,)](
        q, kc, vc, block_tables, cu_q, seq_lens, o, o_part, lse_part, work.unit_seq, work.unit_c, work.ch_first,
        work.count, work.meta, *strides, Hq, scale_log2, Hk=Hk, G=G, BG=max(16, triton.next_power_of_2(G)), D=D,
        BD=BD, BS=BS, BN=plan["BN"], BJ=16, num_warps=plan["num_warps"], num_stages=plan["num_stages"], **extra)

