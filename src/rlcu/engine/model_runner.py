"""Runs the model over the scheduler's packed batch: prepares the tensors, owns the paged KV
pool and the CUDA graphs, samples.

The forward reads the model's weight views (`model.w`) at every step, never a copy: an
optimizer step that updates `model.flat` in place is seen by the next step (CUDA graphs
captured on those views see it too, since the addresses do not change; if `model.flat` is
replaced by another tensor the graphs are captured again).

Per layer, over the N new tokens of the step (packed, any mix of prefill chunks and decodes):
    h = rmsnorm(x); q, k, v = h Wqkv^T; q, k = rope(rmsnorm(q)), rope(rmsnorm(k)) at their positions
    (qkv_prep, one kernel: q, k normed and rotated, k and v written to their cache slots)
    o = paged_attention(q, cache); x += o Wo^T
    x += swiglu(rmsnorm(x) Wgu^T) Wd^T
then the final norm and the LM head only on the rows that sample a token. In exact mode
(ops/exact.py) `_hidden_exact` runs the trainer's ops in the trainer's order instead (no fused
qkv_prep, the batch-invariant GEMM, the exact attention over the cache) and the sampled token's
logprob is taken by the trainer's head kernel (`_sample`).

KV pool: one tensor [2, layers, num_blocks, block_size, Hk, D]. On CUDA its size is what
`gpu_memory_utilization` of the device's memory leaves after everything already allocated
(the trainer's buffers too) and the activations of a warm-up step of the full token budget.

CUDA graphs: pure decode steps (one token per sequence) of up to `max_num_seqs` sequences
replay one graph of the whole step (embedding to the sampled tokens and their logprobs,
the LM head and the sampler included) captured, on first use, for the next batch-size
bucket (1, 2, 4, 8, then multiples of 16) and context bucket (1k, 4k, 16k, ..., max_model_len: the decode kernel's
split-KV grid is sized by the longest context). Padding rows write nowhere (slot -1),
attend to one key and sample at temperature 1 (their tokens are never read). Everything
else runs eagerly.

Readback: a step's samples travel to pinned host buffers behind it on the stream and the
host waits on that copy's event (`collect`), so with the one-step lookahead the host
prepares step t+1 while the device runs step t.

Host side of a decode step (`_decode`, graph or not): one pass over the rows fills a pinned
staging buffer (fields at fixed offsets), sent with one non-blocking copy together with the
block-table entries that changed (tables live on the device per sequence slot, see
`_DecodeState`); prefill and mixed steps pack their arrays in `prepare`. A decode step that
runs the same sequences, in the same order, as the decode step before it (a batch's steady
state) skips that pass: the device advances its copy of the fields (token = the last
step's sample of the row, position, context length and sample offset + 1, KV slot from the
row's table) and the host sends only the table entries that changed.
"""

from __future__ import annotations

import math
import operator

import numpy as np
import torch

from rlcu.engine.scheduler import ScheduledBatch
from rlcu.model.qwen3 import Qwen3
from rlcu.ops.attention_exact import attention_exact_paged
from rlcu.ops.embedding import embedding_fwd
from rlcu.ops.exact import is_exact
from rlcu.ops.kv_cache import kv_write
from rlcu.ops.logprob import token_logprob
from rlcu.ops.matmul_invariant import mm as mm_invariant
from rlcu.ops.paged_attention import paged_attention
from rlcu.ops.qkv_prep import qkv_prep
from rlcu.ops.rmsnorm import rmsnorm_fwd
from rlcu.ops.rope import rope_fwd
from rlcu.ops.sampling import sample
from rlcu.ops.swiglu import swiglu_fwd

CPU_KV_BYTES = 1 << 30  # the largest default KV pool on the CPU (gpu_memory_utilization does not apply there)


def _pack(arrays: list, dtype, device: torch.device) -> list[torch.Tensor]:
    """Concatenate 1-D arrays into one buffer with each start 16 bytes aligned, copy it to the
    device (one non-blocking copy) -> the arrays' views on the device."""
    a = 16 // np.dtype(dtype).itemsize
    starts, n = [], 0
    for x in arrays:
        starts.append(n)
        n += -(-len(x) // a) * a
    host = np.zeros(max(n, 1), dtype=dtype)
    for x, o in zip(arrays, starts):
        host[o:o + len(x)] = x
    buf = torch.from_numpy(host).to(device, non_blocking=True)
    return [buf[o:o + len(x)] for x, o in zip(arrays, starts)]


def graph_buckets(max_bs: int) -> list[int]:
    return sorted({b for b in [1, 2, 4, 8, *range(16, max_bs + 16, 16)] if b < max_bs} | {max_bs})


class _DecodeState:
    """Host and device buffers of pure decode steps, reused every step.

    Every field of a step (ids, positions, KV slots, context lengths, the sampler's
    parameters, each row's slot) lives at a fixed offset of one byte buffer on the device;
    the host fills one of two pinned staging copies (double-buffered: the host runs one step
    ahead of the device) and sends it with ONE non-blocking copy, followed by the step's
    variable part (block-table updates, placeholder rows). Block tables are kept on the
    device per *slot* (a sequence keeps its slot while it decodes), so a step sends only the
    entries that changed: the blocks appended since the last step, and the last block when
    copy-on-write replaced it (BlockManager.reserve changes a table only there)."""

    I64 = ("ids", "slots", "seeds", "offsets", "row_slot")
    VAR_CAP = 1 << 16
    I32 = ("pos", "lens", "top_k")
    F32 = ("temp", "top_p", "min_p")

    def __init__(self, rows: int, width: int, device: torch.device):
        self.rows, self.width, self.device = rows, width, device
        self.num_slots = 2 * rows  # slot num_slots: a zero row for padding rows
        self.slot_tables = torch.zeros(self.num_slots + 1, width, device=device, dtype=torch.int32)
        self.slot_of: dict[int, int] = {}  # seq_id -> slot
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.slot_bt: list = [None] * self.num_slots  # the block-table list whose entries the slot holds
        self.slot_n = [0] * self.num_slots  # entries sent
        self.slot_last = [0] * self.num_slots  # the value of the last entry sent
        self.offsets, off = {}, 0
        for names, size in ((self.I64, 8), (self.I32, 4), (self.F32, 4)):
            for n in names:
                self.offsets[n] = (off, size)
                off += -(-rows * size // 16) * 16  # 16-byte aligned: Triton specialises pointers on it
        self.fixed = off
        self.var_cap = self.VAR_CAP  # int64 entries of the variable part that travel in the same copy
        pin = device.type == "cuda"
        self.dbuf = torch.zeros(off + 8 * self.var_cap, device=device, dtype=torch.uint8)
        self.hbufs = [torch.zeros(off + 8 * self.var_cap, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self.hvar = [h[off:].numpy().view(np.int64) for h in self.hbufs]
        self.dvar = self.dbuf[off:].view(torch.int64)
        self.events = [None, None]
        self.turn = 0
        # the last decode step's sequences, their slots and max context: the next step is its
        # continuation when it runs the same sequences in the same order (see ModelRunner._decode)
        self.prev: list | None = None
        self.prev_slots: list[int] = []
        self.prev_max_k = 0
        self.dev = self._views(self.dbuf)
        self.host = [self._views(h.numpy()) for h in self.hbufs]
        for h in self.host:  # padding rows: write nowhere, attend to one key, sample neutrally
            h["lens"][:] = 1
            h["slots"][:] = -1
            h["row_slot"][:] = self.num_slots
            h["temp"][:] = 1.0
            h["top_p"][:] = 1.0
        self.dbuf.copy_(self.hbufs[0])

    def staging(self, k: int) -> dict:
        """Staging buffer k's host views, once its last copy to the device has been read."""
        if self.events[k] is not None:
            self.events[k].synchronize()
        return self.host[k]

    def send(self, k: int, var: list[int], fixed: bool = True) -> torch.Tensor:
        """Copy staging buffer k's fixed fields (unless `fixed` is False) and `var` (int64) to
        the device in one non-blocking copy (two when `var` exceeds the pinned room) -> var
        on the device. Call `staging(k)` before filling the buffer."""
        n, lo = len(var), 0 if fixed else self.fixed
        if n <= self.var_cap:
            if n:
                self.hvar[k][:n] = var
            end = self.fixed + 8 * n
            if end > lo:
                self.dbuf[lo:end].copy_(self.hbufs[k][lo:end], non_blocking=True)
            out = self.dvar[:n]
        else:  # a large table refill (many new sequences at once)
            if fixed:
                self.dbuf[:self.fixed].copy_(self.hbufs[k][:self.fixed], non_blocking=True)
            out = torch.from_numpy(np.array(var, dtype=np.int64)).to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            if self.events[k] is None:
                self.events[k] = torch.cuda.Event()
            self.events[k].record()
        return out

    def sync_table(self, sl: int, bt: list[int], upd_i: list[int], upd_v: list[int]) -> None:
        """Queue the entries of slot sl's device block table that differ from `bt`: the blocks
        appended since they were last sent, and the last one sent when copy-on-write replaced
        it (BlockManager.reserve changes a table only there)."""
        if self.slot_bt[sl] is bt:
            n = self.slot_n[sl]
            if n > len(bt):
                n = 0
            elif n and bt[n - 1] != self.slot_last[sl]:
                n -= 1
        else:
            self.slot_bt[sl], n = bt, 0
        L = len(bt)
        if L > n:
            base = sl * self.width
            upd_i.extend(range(base + n, base + L))
            upd_v.extend(bt[n:])
            self.slot_n[sl], self.slot_last[sl] = L, bt[-1]

    def _views(self, buf) -> dict:
        out = {}
        for n, (o, size) in self.offsets.items():
            dt = {8: "i8", 4: "i4"}[size] if n not in self.F32 else "f4"
            v = buf[o:o + self.rows * size]
            if isinstance(v, torch.Tensor):
                v = v.view({"i8": torch.int64, "i4": torch.int32, "f4": torch.float32}[dt])
            else:
                v = v.view(np.dtype(dt))
            out[n] = v
        return out

    def reset(self) -> None:
        """Forget which sequence holds which slot (every sequence was preempted)."""
        self.prev = None
        self.slot_of.clear()
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.slot_bt = [None] * self.num_slots
        self.slot_n = [0] * self.num_slots

    def assign(self, seq, live) -> int:
        """A slot for `seq` (slots of sequences not in this step are reclaimed when none is free)."""
        if not self.free:
            keep = {s.seq_id for s in live}
            for sid, sl in list(self.slot_of.items()):
                if sid not in keep:
                    del self.slot_of[sid]
                    self.slot_bt[sl] = None
                    self.free.append(sl)
        sl = self.free.pop()
        self.slot_of[seq.seq_id] = sl
        self.slot_bt[sl] = None
        return sl


class ModelRunner:
    def __init__(self, model: Qwen3, *, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, num_kv_blocks: int | None = None, gpu_memory_utilization: float = 0.6,
                 enforce_eager: bool = False):
        self.model = model
        c = self.cfg = model.cfg
        self.device, self.dtype = model.device, model.dtype
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.gpu_memory_utilization = gpu_memory_utilization
        self.use_graphs = self.device.type == "cuda" and not enforce_eager
        self.block_bytes = 2 * c.num_hidden_layers * block_size * c.kv_size * torch.finfo(self.dtype).bits // 8
        self.num_blocks = num_kv_blocks if num_kv_blocks is not None else self._auto_num_blocks(max_model_len)
        self.max_model_len = min(max_model_len, self.num_blocks * block_size)
        self.kv: torch.Tensor | None = None
        self.graphs: dict[tuple[int, int], tuple] = {}  # (batch, context bucket) -> (replay, output)
        self._static: dict[str, torch.Tensor] | None = None
        self._pool = None
        self._capture_stream: torch.cuda.Stream | None = None
        self._graph_flat_ptr = model.flat.data_ptr()
        self._graph_exact = is_exact()  # the mode the graphs were captured in
        self._last_tokens: torch.Tensor | None = None  # the samples of the last launch (placeholder values)
        self._dec: _DecodeState | None = None  # decode steps' staging buffers and per-slot block tables
        self.num_continued = 0  # decode steps that continued the one before on the device (_decode)
        self._rb: list = [None, None]  # pinned host buffers of the samples (see _readback)
        self._graph_kv_ptr = 0  # the KV pool's address when graphs were kept through a release
        self.graph_wakes = {"kept": 0, "recaptured": 0}  # wakes after release(keep_graphs=True)
        self._rb_turn = 0
        self.allocate()

    # ------------------------------------------------------------------ the forward
    def _hidden(self, ids, pos, slots, block_tables, cu_q, seq_lens, max_q: int, max_k: int, rows=None):
        """ids, pos (int32), slots (int64): [N]; block_tables [S, W] int32; cu_q [S+1], seq_lens [S]
        int32; rows: [R] indices of the tokens whose logits are wanted (None: all)
        -> final-normed hidden states [R, hidden]."""
        c, w = self.cfg, self.model.w
        N, Hq, Hk, D, eps = ids.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        qs = c.q_size
        scale = D**-0.5
        x = embedding_fwd(ids, w["embed"])
        if is_exact():
            return self._hidden_exact(x, pos, slots, block_tables, cu_q, seq_lens, max_q, rows)
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            h, _ = rmsnorm_fwd(x, w[p + "input_norm"], eps)
            qkv = h @ w[p + "qkv"].t()  # [N, (Hq + 2 Hk) D]
            kc, vc = self.kv[0, i], self.kv[1, i]
            q = qkv_prep(qkv, w[p + "q_norm"], w[p + "k_norm"], pos, slots, kc, vc, Hq, Hk, D, eps, c.rope_theta)
            o = paged_attention(q, kc, vc, block_tables, cu_q, seq_lens, max_q, max_k, scale)
            x.addmm_(o.view(N, qs), w[p + "o"].t())  # in place: no copy of x for cuBLAS's C
            h, _ = rmsnorm_fwd(x, w[p + "post_norm"], eps)
            x.addmm_(swiglu_fwd(h @ w[p + "gate_up"].t()), w[p + "down"].t())
        if rows is not None:
            x = x.index_select(0, rows)
        return rmsnorm_fwd(x, w["final_norm"], eps)[0]

    def _hidden_exact(self, x, pos, slots, block_tables, cu_q, seq_lens, max_q: int, rows):
        """Exact mode's layers (ops/exact.py): the trainer's ops in the trainer's order (norms
        and rope as Qwen3._layer_fwd runs them, not the fused qkv_prep), the batch-invariant
        GEMM, and the attention kernel the trainer runs, here over the paged cache."""
        c, w = self.cfg, self.model.w
        N, Hq, Hk, D, eps = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        qs, ks = c.q_size, c.kv_size
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            h, _ = rmsnorm_fwd(x, w[p + "input_norm"], eps)
            qkv = mm_invariant(h, w[p + "qkv"])  # [N, (Hq + 2 Hk) D]
            q = rmsnorm_fwd(qkv[:, :qs].reshape(N * Hq, D), w[p + "q_norm"], eps)[0]
            k = rmsnorm_fwd(qkv[:, qs:qs + ks].reshape(N * Hk, D), w[p + "k_norm"], eps)[0]
            q, k = rope_fwd(q.view(N, Hq, D), pos, c.rope_theta), rope_fwd(k.view(N, Hk, D), pos, c.rope_theta)
            kc, vc = self.kv[0, i], self.kv[1, i]
            kv_write(k, qkv[:, qs + ks:].reshape(N, Hk, D), kc, vc, slots)
            o = attention_exact_paged(q, kc, vc, block_tables, cu_q, seq_lens, max_q, D**-0.5)
            mm_invariant(o.view(N, qs), w[p + "o"], x, out=x)  # x += o Wo^T, in place
            h, _ = rmsnorm_fwd(x, w[p + "post_norm"], eps)
            mm_invariant(swiglu_fwd(mm_invariant(h, w[p + "gate_up"])), w[p + "down"], x, out=x)
        if rows is not None:
            x = x.index_select(0, rows)
        return rmsnorm_fwd(x, w["final_norm"], eps)[0]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """[R, V] in the model's dtype (the sampler computes in fp32; as the trainer's logprob
        op does, the logits are rounded to the model's dtype first)."""
        if is_exact():
            return mm_invariant(h, self.model.lm_head)
        return h @ self.model.lm_head.t()

    def _sample(self, h: torch.Tensor, samp: tuple):
        """The LM head and the sampler on final hidden rows -> (tokens, logprobs). In exact mode
        the logprob of each sampled token is the trainer's head kernel's on the same logits."""
        logits = self._logits(h)
        tokens, logprobs = sample(logits, *samp)
        if is_exact():
            logprobs = token_logprob(logits, tokens, samp[0])
        return tokens, logprobs

    # ------------------------------------------------------------------ one step
    def prepare(self, batch: ScheduledBatch):
        """Host-side packing of a step into numpy arrays (see `_hidden` for their meaning)."""
        bs, seqs = self.block_size, batch.seqs
        S = len(seqs)
        c = [s.num_computed_tokens for s in seqs]
        width = max(len(s.block_table) for s in seqs)
        tables = np.zeros((S, width), dtype=np.int32)
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = s.block_table
        if batch.is_decode:
            ids = np.array([s.token_ids[ci] for s, ci in zip(seqs, c)], dtype=np.int64)
            pos = np.array(c, dtype=np.int32)
            slots = np.array([s.block_table[ci // bs] * bs + ci % bs for s, ci in zip(seqs, c)], dtype=np.int64)
            lens = pos + 1
            cu = np.arange(S + 1, dtype=np.int32)
            rows = np.arange(S, dtype=np.int64)
        else:
            take = np.array(batch.num_tokens, dtype=np.int64)
            cu = np.zeros(S + 1, dtype=np.int32)
            np.cumsum(take, out=cu[1:])
            lens = (np.array(c, dtype=np.int32) + take).astype(np.int32)
            ids = np.array([t for s, ci, n in zip(seqs, c, batch.num_tokens) for t in s.token_ids[ci:ci + n]],
                           dtype=np.int64)
            pos = np.concatenate([np.arange(ci, ci + n, dtype=np.int32) for ci, n in zip(c, batch.num_tokens)])
            seq_of = np.repeat(np.arange(S), take)
            slots = tables[seq_of, pos // bs].astype(np.int64) * bs + pos % bs
            rows = np.repeat(cu[1:].astype(np.int64) - 1, batch.num_samples)
        ph = np.flatnonzero(ids < 0)  # placeholders: tokens sampled by the last step, still on the device
        ph_rows = np.array([seqs[i].pending_row for i in np.searchsorted(cu, ph, side="right") - 1], dtype=np.int64)
        return dict(ids=ids, pos=pos, slots=slots, tables=tables, cu=cu, lens=lens, rows=rows, ph=ph, ph_rows=ph_rows,
                    max_q=max(batch.num_tokens), max_k=int(lens.max()))

    def _to_device(self, a):
        """Two host-to-device copies (one int64, one int32 buffer) instead of nine; every
        array starts 16 bytes aligned, so the kernels see the same pointer alignment (and
        Triton compiles no new variant) whatever the step's sizes."""
        ids, slots, rows, ph, ph_rows = _pack([a["ids"], a["slots"], a["rows"], a["ph"], a["ph_rows"]], np.int64,
                                              self.device)
        pos, cu, lens, tables = _pack([a["pos"], a["cu"], a["lens"], a["tables"].ravel()], np.int32, self.device)
        if len(ph):
            ids.index_copy_(0, ph, self._last_tokens.index_select(0, ph_rows))
        return ids, pos, slots, tables.view(len(a["lens"]), -1), cu, lens, rows

    def _sampling_tensors(self, batch: ScheduledBatch):
        fl, il = [], []  # rows of (temperature, top_p, min_p) and (top_k, seed, offset)
        for seq, ns in zip(batch.seqs, batch.num_samples):
            if ns == 0:
                continue
            sp = seq.params
            off = len(seq.token_ids) - seq.num_prompt_tokens
            if ns == 1:
                fl.append((sp.temperature, sp.top_p, sp.min_p))
                il.append((sp.top_k, seq.own_seed, off))
            else:
                fl += [(sp.temperature, sp.top_p, sp.min_p)] * ns
                il += [(sp.top_k, sd, off) for sd in seq.sample_seeds()]
        fl, il = np.array(fl, dtype=np.float32).T, np.array(il, dtype=np.int64).T
        temp, top_p, min_p = _pack(list(fl), np.float32, self.device)
        top_k, seeds, offsets = _pack(list(il), np.int64, self.device)
        return temp, top_k.to(torch.int32), top_p, min_p, seeds, offsets

    @torch.no_grad()
    def launch(self, batch: ScheduledBatch):
        """Enqueue one step on the device and return at once: (tokens, logprobs) device
        tensors of the step's samples (in batch order, n per unforked leader; None when no
        chunk was final) and whether a CUDA graph ran. Placeholder tokens of `batch` are
        the samples of the previous launch."""
        if self.kv is None:
            raise RuntimeError("the KV pool is released (the engine is asleep): call wake() first")
        if batch.copies:
            idx = torch.tensor(batch.copies, dtype=torch.int64).t().to(self.device)
            self.kv[:, :, idx[1]] = self.kv[:, :, idx[0]]
        if batch.is_decode and len(batch.seqs) <= self.max_num_seqs:
            graph = self.use_graphs
            out = self._decode(batch)
        else:
            graph = False
            if self._dec is not None:
                self._dec.prev = None  # the next decode step is no continuation of a decode step
            a = self.prepare(batch)
            ids, pos, slots, tables, cu, lens, rows = self._to_device(a)
            h = self._hidden(ids, pos, slots, tables, cu, lens, a["max_q"], a["max_k"], rows)
            if not len(a["rows"]):  # only non-final prefill chunks: nothing to sample
                return None, graph
            out = self._sample(h, self._sampling_tensors(batch))
        self._last_tokens = out[0]
        return self._readback(out), graph

    def _readback(self, out):
        """Start the copy of a step's (tokens, logprobs) to pinned host memory, behind the
        step on the stream -> (tokens, logprobs, event) for `collect`. Waiting on the event
        rather than on `.tolist()` matters: `.tolist()` would also wait for every step
        enqueued after this one (the lookahead step), serialising host and device. Two
        buffers alternate: a step's copy is read (`collect`) before the launch after next."""
        if self.device.type != "cuda":  # copies: a graph's outputs are overwritten by the next replay
            return out[0].clone(), out[1].clone(), None
        n = out[0].shape[0]
        k = self._rb_turn
        self._rb_turn ^= 1
        if self._rb[k] is None or self._rb[k][0].shape[0] < n:
            cap = max(n, self.max_num_seqs)
            self._rb[k] = (torch.empty(cap, dtype=torch.int64, pin_memory=True),
                           torch.empty(cap, dtype=torch.float32, pin_memory=True), torch.cuda.Event())
        tok, lp, ev = self._rb[k]
        tok[:n].copy_(out[0], non_blocking=True)
        lp[:n].copy_(out[1], non_blocking=True)
        ev.record()
        return tok[:n], lp[:n], ev

    @staticmethod
    def collect(out) -> tuple[list[int], list[float]]:
        """Wait for a launched step's samples."""
        if out is None:
            return [], []
        if out[2] is not None:
            out[2].synchronize()
        return out[0].tolist(), out[1].tolist()

    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[float], bool]:
        """launch + collect."""
        out, graph = self.launch(batch)
        return (*self.collect(out), graph)

    # ------------------------------------------------------------------ decode steps
    def _dec_state(self) -> _DecodeState:
        if self._dec is None:
            self._dec = _DecodeState(self.max_num_seqs, math.ceil(self.max_model_len / self.block_size), self.device)
        return self._dec

    def _decode(self, batch: ScheduledBatch):
        """A pure decode step (one token, one sample per sequence): stage, send, run the model
        and the sampler (one CUDA graph when enabled) -> (tokens [S], logprobs [S]).

        A step that runs the same sequences in the same order as the decode step before it
        (the steady state of a batch) is its continuation: every row's token is that step's
        sample of the same row, its position, context length and sample offset one more, its
        sampling parameters the same. The device then advances its own copy of those fields,
        and the host sends only the block-table entries that changed."""
        d, bs, seqs = self._dec_state(), self.block_size, batch.seqs
        S = len(seqs)
        prev = d.prev
        cont = (prev is not None and len(prev) == S and self._last_tokens is not None
                and all(map(operator.is_, seqs, prev)))
        max_k = d.prev_max_k + 1 if cont else max(s.num_computed_tokens for s in seqs) + 1
        graph = self.use_graphs
        if graph:
            if self.model.flat.data_ptr() != self._graph_flat_ptr or self._graph_exact != is_exact():
                # the weights moved, or exact mode was switched: the graphs hold other kernels
                self.graphs, self._static, self._pool = {}, None, None
                self._graph_flat_ptr = self.model.flat.data_ptr()
                self._graph_exact = is_exact()
            key = self._graph_key(S, max_k)
            b, W = key[0], math.ceil(key[1] / bs)
        else:
            b, W = S, -(-max_k // bs)
        k = d.turn
        d.turn ^= 1
        v = d.dev
        if cont:
            self.num_continued += 1
            upd_i, upd_v = [], []
            slot_bt, slot_n, slot_last = d.slot_bt, d.slot_n, d.slot_last
            for s, sl in zip(seqs, d.prev_slots):
                bt = s.block_table
                if slot_bt[sl] is not bt or slot_n[sl] != len(bt) or slot_last[sl] != bt[-1]:
                    d.sync_table(sl, bt, upd_i, upd_v)
            K = len(upd_i)
            if K:
                d.staging(k)
                var = d.send(k, upd_i + upd_v, fixed=False)
                d.slot_tables.view(-1).index_copy_(0, var[:K], var[K:].to(torch.int32))
            v["ids"][:S].copy_(self._last_tokens[:S])
            for f in ("pos", "lens", "offsets"):
                v[f][:S] += 1
            pos = v["pos"][:S]  # the KV slot of each row's token: its block's entry in the row's table
            blk = d.slot_tables.view(-1)[v["row_slot"][:S] * d.width + torch.div(pos, bs, rounding_mode="floor")]
            torch.add(pos % bs, blk.to(torch.int64), alpha=bs, out=v["slots"][:S])
        else:
            self._stage(d, k, seqs, b)
        d.prev, d.prev_max_k = seqs, max_k
        if graph:
            if key not in self.graphs:
                self._capture(*key)
            st = self._static
            st["tables"][:b, :W] = d.slot_tables[v["row_slot"][:b], :W]
            replay, (tokens, logprobs) = self.graphs[key]
            replay()
            return tokens[:S], logprobs[:S]
        tables = d.slot_tables[v["row_slot"][:S], :max(W, 1)]
        cu = torch.arange(S + 1, device=self.device, dtype=torch.int32)
        h = self._hidden(v["ids"][:S], v["pos"][:S], v["slots"][:S], tables, cu, v["lens"][:S], 1, max_k)
        return self._sample(h, self._decode_sampling(S))

    def _stage(self, d: _DecodeState, k: int, seqs: list, b: int) -> None:
        """A decode step's fields from the host: one pass over the rows into staging buffer k,
        one copy to the device (fixed fields, then table updates and placeholder rows)."""
        bs, S = self.block_size, len(seqs)
        h = d.staging(k)
        slot_of, slot_bt, slot_n, slot_last = d.slot_of, d.slot_bt, d.slot_n, d.slot_last
        ids, kvs, offs, rs, sd = [], [], [], [], []
        upd_i, upd_v, ph, ph_rows, fl = [], [], [], [], []
        for i, s in enumerate(seqs):
            sl = slot_of.get(s.seq_id)
            if sl is None:
                sl = d.assign(s, seqs)
            bt = s.block_table
            if slot_bt[sl] is not bt or slot_n[sl] != len(bt) or slot_last[sl] != bt[-1]:
                d.sync_table(sl, bt, upd_i, upd_v)
            c = s.num_computed_tokens
            t = s.token_ids[c]
            if t < 0:  # a placeholder: the token sampled by the last step, still on the device
                ph.append(i)
                ph_rows.append(s.pending_row)
            ids.append(t)
            kvs.append(bt[c // bs] * bs + c % bs)
            offs.append(len(s.token_ids) - s.num_prompt_tokens)
            rs.append(sl)
            sp = s.params
            fl.append((sp.temperature, sp.top_p, sp.min_p))
            sd.append((sp.top_k, s.own_seed))
        d.prev_slots = rs
        h["ids"][:S] = ids
        h["ids"][S:b] = 0
        h["slots"][:S] = kvs
        h["slots"][S:b] = -1
        pos = h["pos"]
        pos[:S] = [s.num_computed_tokens for s in seqs]
        pos[S:b] = 0
        h["lens"][:S] = pos[:S] + 1
        h["lens"][S:b] = 1
        h["row_slot"][:S] = rs
        h["row_slot"][S:b] = d.num_slots
        f = np.array(fl, dtype=np.float32)
        h["temp"][:S], h["top_p"][:S], h["min_p"][:S] = f[:, 0], f[:, 1], f[:, 2]
        si = np.array(sd, dtype=np.int64)
        h["top_k"][:S], h["seeds"][:S] = si[:, 0], si[:, 1]
        h["offsets"][:S] = offs
        # the device half: one copy (fixed fields, then table updates and placeholder rows)
        K, P = len(upd_i), len(ph)
        var = d.send(k, upd_i + ph + ph_rows + upd_v)
        if K:
            d.slot_tables.view(-1).index_copy_(0, var[:K], var[K + 2 * P:].to(torch.int32))
        v = d.dev
        if P:
            v["ids"].index_copy_(0, var[K:K + P], self._last_tokens.index_select(0, var[K + P:K + 2 * P]))

    def _decode_sampling(self, n: int) -> tuple:
        """The sampler's per-row tensors of a decode step's first n rows (in the staging buffer)."""
        v = self._dec_state().dev
        return v["temp"][:n], v["top_k"][:n], v["top_p"][:n], v["min_p"][:n], v["seeds"][:n], v["offsets"][:n]

    # ------------------------------------------------------------------ KV pool, graphs
    def _auto_num_blocks(self, max_model_len: int) -> int:
        if self.device.type != "cuda":  # room for 4 longest sequences (or the token budget), at most 1 GiB
            want = -(-max(4 * max_model_len, self.max_num_batched_tokens) // self.block_size)
            return max(min(want, CPU_KV_BYTES // self.block_bytes), 1)
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        self._warmup(max_model_len)
        torch.cuda.synchronize(dev)
        activations = torch.cuda.max_memory_allocated(dev) - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        budget = total * self.gpu_memory_utilization - (total - free) - activations
        n = int(budget // self.block_bytes)
        if n < 1:
            gib = 1 << 30
            raise RuntimeError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} leaves no room for the KV cache: "
                f"{(total - free) / gib:.1f} GiB of {total / gib:.1f} GiB in use, {activations / gib:.2f} GiB "
                f"for activations; raise gpu_memory_utilization, lower max_num_batched_tokens, or free memory")
        return n

    def _warmup(self, max_model_len: int) -> None:
        """A forward of the full token budget over a one-block pool (nothing is written;
        attention reads block 0 again and again), to measure peak activation memory."""
        c = self.cfg
        self.kv = torch.zeros(2, c.num_hidden_layers, 1, self.block_size, c.num_key_value_heads, c.head_dim,
                              device=self.device, dtype=self.dtype)
        N = self.max_num_batched_tokens
        L = min(N, max_model_len)
        lens = [L] * (N // L) + ([N % L] if N % L else [])
        d = self.device
        cu = torch.tensor([0] + np.cumsum(lens).tolist(), device=d, dtype=torch.int32)
        pos = torch.cat([torch.arange(n, device=d, dtype=torch.int32) for n in lens])
        ids = torch.zeros(N, device=d, dtype=torch.int64)
        slots = torch.full((N,), -1, device=d, dtype=torch.int64)
        tables = torch.zeros(len(lens), -(-L // self.block_size), device=d, dtype=torch.int32)
        rows = torch.full((min(self.max_num_seqs, N),), N - 1, device=d, dtype=torch.int64)
        seq_lens = torch.tensor(lens, device=d, dtype=torch.int32)
        self._logits(self._hidden(ids, pos, slots, tables, cu, seq_lens, max(lens), L, rows))
        self.kv = None

    def allocate(self) -> None:
        """Take the KV pool (graphs are captured on first use). Graphs kept through a
        `release(keep_graphs=True)` stay only if the new pool sits at the old address (the
        graphs hold its addresses); else they are dropped and captured again."""
        if self.kv is None:
            c = self.cfg
            self.kv = torch.zeros(2, c.num_hidden_layers, self.num_blocks, self.block_size, c.num_key_value_heads,
                                  c.head_dim, device=self.device, dtype=self.dtype)
            if self.graphs:
                kept = self.kv.data_ptr() == self._graph_kv_ptr
                self.graph_wakes["kept" if kept else "recaptured"] += 1
                if not kept:
                    self.graphs, self._static, self._pool = {}, None, None

    def release(self, keep_graphs: bool = False) -> None:
        """Give the KV pool, and unless keep_graphs the graphs, back to the allocator (and the
        device). Kept graphs hold their memory pool (the activations of one decode step per
        batch bucket: tens of MB, against GBs of KV)."""
        if keep_graphs and self.graphs and self.kv is not None:
            self._graph_kv_ptr = self.kv.data_ptr()
            self._dec.reset()
        else:
            self.graphs, self._static, self._pool, self._dec = {}, None, None, None
        self.kv = None
        if self.device.type == "cuda":
            # this engine's stream only: jobs sharing the device on their own streams go on
            torch.cuda.current_stream(self.device).synchronize()
            torch.cuda.empty_cache()

    def _graph_key(self, S: int, max_k: int) -> tuple[int, int]:
        """(batch bucket, context bucket): the decode kernel's split count follows max_seqlen_k,
        so graphs are kept per context bucket (1k, 4k, 16k, ... up to max_model_len)."""
        b = next(b for b in graph_buckets(self.max_num_seqs) if b >= S)
        kb = 1024
        while kb < max_k:
            kb *= 4
        return b, min(kb, self.max_model_len)

    @torch.no_grad()
    def _capture(self, b: int, kb: int) -> None:
        d = self.device
        if self._static is None:
            max_bs, W = self.max_num_seqs, math.ceil(self.max_model_len / self.block_size)
            v = self._dec_state().dev  # ids, pos, slots, lens: filled by the decode step's one copy
            self._static = dict(
                ids=v["ids"], pos=v["pos"], slots=v["slots"], lens=v["lens"],
                tables=torch.zeros(max_bs, W, device=d, dtype=torch.int32),
                cu=torch.arange(max_bs + 1, device=d, dtype=torch.int32),
            )
            self._pool = torch.cuda.graph_pool_handle() if d.type == "cuda" else None
        st = self._static
        args = (st["ids"][:b], st["pos"][:b], st["slots"][:b], st["tables"][:b], st["cu"][:b + 1], st["lens"][:b],
                1, kb)
        saved = {k: v.clone() for k, v in st.items() if k != "tables"}
        st["slots"].fill_(-1)  # the warm-up and capture runs must write nowhere
        st["lens"].fill_(1)
        samp = self._decode_sampling(b)

        def step():
            return self._sample(self._hidden(*args), samp)

        step()  # compiles the kernels outside the capture
        self.graphs[(b, kb)] = self._record(step)
        for k, v in saved.items():
            st[k].copy_(v)

    def _record(self, fn) -> tuple:
        """Capture fn() -> (replay function, its outputs). The capture stream is this runner's
        own: torch's default one is made once per process, on the device current at the first
        capture, and capturing on it would switch a later capture to that device."""
        torch.cuda.synchronize(self.device)
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool, stream=self._capture_stream):
            out = fn()
        torch.cuda.synchronize(self.device)
        return g.replay, out

    def capture_graphs(self, max_context: int) -> int:
        """Capture now (not on first use) the graphs of every batch bucket for the context
        buckets up to `max_context`; returns how many graphs exist."""
        if self.use_graphs and self.kv is not None:
            kbs = sorted({self._graph_key(1, k)[1] for k in range(1, min(max_context, self.max_model_len) + 1, 1024)}
                         | {self._graph_key(1, min(max_context, self.max_model_len))[1]})
            for kb in kbs:
                for b in reversed(graph_buckets(self.max_num_seqs)):
                    if (b, kb) not in self.graphs:
                        self._capture(b, kb)
        return len(self.graphs)
