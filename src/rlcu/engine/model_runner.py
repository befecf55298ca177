"""Runs the model over the scheduler's packed batch: prepares the tensors, owns the paged KV
pool and the CUDA graphs, samples.

The forward reads the model's weight views (`model.w`) at every step, never a copy: an
optimizer step that updates `model.flat` in place is seen by the next step (CUDA graphs
captured on those views see it too, since the addresses do not change; if `model.flat` is
replaced by another tensor the graphs are captured again).

Per layer, over the N new tokens of the step (packed, any mix of prefill chunks and decodes):
    h = rmsnorm(x); q, k, v = h Wqkv^T; q, k = rope(rmsnorm(q)), rope(rmsnorm(k)) at their positions
    (qkv_prep, one kernel: q, k normed and rotated, k and v written to their kv slots)
    o = paged_attention(q, cache); x += o Wo^T
    x += swiglu(rmsnorm(x) Wgu^T) Wd^T
then the final norm and the LM head only on the rows that sample a token. In exact mode
(ops/exact.py) `_hidden_exact` runs the trainer's ops in the trainer's order instead (qkv_prep
with its stats, as the trainer's forward runs it, the batch-invariant GEMM, the exact attention
over the cache) and the sampled token's logprob is taken by the trainer's head kernel (`_sample`).

KV pool: one tensor [2, layers, num_blocks, block_size, Hk, D]. On CUDA its size is what
`gpu_memory_utilization` of the device's memory leaves after everything already allocated
(the trainer's buffers too), the activations of a step of the full token budget and, with
graphs, the graphs' private pool (about one decode step of `max_num_seqs` rows).

CUDA graphs: pure decode steps (one token per sequence) of up to `max_num_seqs` sequences
replay one graph of the whole step (embedding to the sampled tokens and their logprobs,
the LM head and the sampler included) captured for the next batch-size bucket (1, 2, 4, 8,
then multiples of 16) and context bucket (1k, 4k, 16k, ..., max_model_len: the decode
kernel's split-KV grid is sized by the longest context; a batch wide enough to run unsplit
has one graph for every context), all at the engine's start (engine/warmup.py), else or
after a wake that dropped them on first use. Padding rows write
nowhere (kv slot -1), attend to one key and sample at temperature 1 (their tokens are never
read). Everything else runs eagerly.

Readback: a step's samples travel to pinned host buffers behind it on the stream and the
host waits on that copy's event (`collect`), so with the one-step lookahead the host
prepares step t+1 while the device runs step t.

Host side: a pure decode step's fields, its block tables on the device and whether it
continues the step before are all `DecodeState`'s (engine/decode_state.py): one staging
copy a step, or none beyond the changed table entries when the step continues the last one
(`ScheduledBatch.continues`). Prefill and mixed steps (and decode steps wider than
`max_num_seqs`, from a request with n above it) pack their arrays in `prepare`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from rlcu.engine import warmup
from rlcu.engine.decode_state import DecodeState
from rlcu.engine.scheduler import ScheduledBatch
from rlcu.engine.warmup import context_bucket, graph_buckets
from rlcu.model.qwen3 import Qwen3
from rlcu.ops.attention_exact import attention_exact_paged
from rlcu.ops.embedding import embedding_fwd
from rlcu.ops.exact import is_exact
from rlcu.ops.logprob import token_logprob
from rlcu.ops.matmul_invariant import mm as mm_invariant
from rlcu.ops.paged_attention import _num_sms, decode_plan, paged_attention
from rlcu.ops.qkv_prep import qkv_prep
from rlcu.ops.rmsnorm import rmsnorm_fwd
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


class _Readback:
    """Two pinned host buffers of a step's (tokens, logprobs) that alternate: a step's copy is
    read (`ModelRunner.collect`) before the launch after next reuses its buffer."""

    def __init__(self, cap: int):
        self.cap, self.bufs, self.turn = cap, [None, None], 0

    def start(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple:
        """Queue the copies behind the step on the stream -> (tokens, logprobs, event)."""
        n, k = tokens.shape[0], self.turn
        self.turn ^= 1
        if self.bufs[k] is None or self.bufs[k][0].shape[0] < n:
            cap = max(n, self.cap)
            self.bufs[k] = (torch.empty(cap, dtype=torch.int64, pin_memory=True),
                            torch.empty(cap, dtype=torch.float32, pin_memory=True), torch.cuda.Event())
        tok, lp, ev = self.bufs[k]
        tok[:n].copy_(tokens, non_blocking=True)
        lp[:n].copy_(logprobs, non_blocking=True)
        ev.record()
        return tok[:n], lp[:n], ev


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
        self.memory_probe: dict = {}  # what the pool's sizing set aside (_auto_num_blocks)
        self.num_blocks = num_kv_blocks if num_kv_blocks is not None else self._auto_num_blocks(max_model_len)
        self.max_model_len = min(max_model_len, self.num_blocks * block_size)
        self.kv: torch.Tensor | None = None
        self.graphs: dict[tuple[int, int], tuple] = {}  # (batch, context bucket) -> (replay, output)
        self._static: dict[str, torch.Tensor] | None = None
        self._pool = None
        self._capture_stream: torch.cuda.Stream | None = None
        self._graph_flat_ptr = model.flat.data_ptr()
        self._graph_exact = is_exact()  # the mode the graphs were captured in
        self._last_samples: torch.Tensor | None = None  # the tokens sampled by the last launch (placeholders' values)
        self._dec: DecodeState | None = None  # everything of the pure decode steps (engine/decode_state.py)
        self._rb = _Readback(max_num_seqs)  # pinned host buffers of the samples (see _readback)
        self._graph_kv_ptr = 0  # the KV pool's address when graphs were kept through a release
        self.graph_wakes = {"kept": 0, "recaptured": 0}  # wakes after release(keep_graphs=True)
        self.num_captures = 0  # CUDA graphs captured by this runner, ever
        self.allocate()

    @property
    def num_continued(self) -> int:
        """Decode steps that continued the one before on the device, since the decode state was
        made (a release without keep_graphs drops it)."""
        return self._dec.num_continued if self._dec is not None else 0

    # ------------------------------------------------------------------ the forward
    def _hidden(self, ids, pos, kv_slots, block_tables, cu_q, seq_lens, max_q: int, max_k: int, rows=None):
        """ids, pos (int32), kv_slots (int64, -1: write nowhere): [N]; block_tables [S, W] int32;
        cu_q [S+1], seq_lens [S] int32; rows: [R] indices of the tokens whose logits are wanted (None: all)
        -> final-normed hidden states [R, hidden]."""
        c, w = self.cfg, self.model.w
        N, Hq, Hk, D, eps = ids.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        qs = c.q_size
        scale = D**-0.5
        x = embedding_fwd(ids, w["embed"])
        if is_exact():
            return self._hidden_exact(x, pos, kv_slots, block_tables, cu_q, seq_lens, max_q, rows)
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            h, _ = rmsnorm_fwd(x, w[p + "input_norm"], eps)
            qkv = h @ w[p + "qkv"].t()  # [N, (Hq + 2 Hk) D]
            kc, vc = self.kv[0, i], self.kv[1, i]
            q = qkv_prep(qkv, w[p + "q_norm"], w[p + "k_norm"], pos, kv_slots, kc, vc, Hq, Hk, D, eps, c.rope_theta)
            o = paged_attention(q, kc, vc, block_tables, cu_q, seq_lens, max_q, max_k, scale)
            x.addmm_(o.view(N, qs), w[p + "o"].t())  # in place: no copy of x for cuBLAS's C
            h, _ = rmsnorm_fwd(x, w[p + "post_norm"], eps)
            x.addmm_(swiglu_fwd(h @ w[p + "gate_up"].t()), w[p + "down"].t())
        if rows is not None:
            x = x.index_select(0, rows)
        return rmsnorm_fwd(x, w["final_norm"], eps)[0]

    def _hidden_exact(self, x, pos, kv_slots, block_tables, cu_q, seq_lens, max_q: int, rows):
        """Exact mode's layers (ops/exact.py): the trainer's ops in the trainer's order (the q/k
        norm and rope by the fused kernel that Qwen3._layer_fwd runs in exact mode too), the
        batch-invariant GEMM, and the attention kernel the trainer runs, over the paged cache."""
        c, w = self.cfg, self.model.w
        N, Hq, Hk, D, eps = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        qs = c.q_size
        for i in range(c.num_hidden_layers):
            p = f"layers.{i}."
            h, _ = rmsnorm_fwd(x, w[p + "input_norm"], eps)
            qkv = mm_invariant(h, w[p + "qkv"])  # [N, (Hq + 2 Hk) D]
            kc, vc = self.kv[0, i], self.kv[1, i]
            # the kernel the trainer's forward runs (qk_norm_rope), its stats included
            q = qkv_prep(qkv, w[p + "q_norm"], w[p + "k_norm"], pos, kv_slots, kc, vc, Hq, Hk, D, eps,
                         c.rope_theta, True)[0]
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
        take = np.array(batch.num_tokens, dtype=np.int64)
        cu = np.zeros(S + 1, dtype=np.int32)
        np.cumsum(take, out=cu[1:])
        lens = (np.array(c, dtype=np.int32) + take).astype(np.int32)
        ids = np.array([t for s, ci, n in zip(seqs, c, batch.num_tokens) for t in s.token_ids[ci:ci + n]],
                       dtype=np.int64)
        pos = np.concatenate([np.arange(ci, ci + n, dtype=np.int32) for ci, n in zip(c, batch.num_tokens)])
        seq_of = np.repeat(np.arange(S), take)
        kv_slots = tables[seq_of, pos // bs].astype(np.int64) * bs + pos % bs
        rows = np.repeat(cu[1:].astype(np.int64) - 1, batch.num_samples)
        ph = np.flatnonzero(ids < 0)  # placeholders: tokens sampled by the last step, still on the device
        ph_rows = np.array([seqs[i].pending_row for i in np.searchsorted(cu, ph, side="right") - 1], dtype=np.int64)
        return dict(ids=ids, pos=pos, kv_slots=kv_slots, tables=tables, cu=cu, lens=lens, rows=rows, ph=ph,
                    ph_rows=ph_rows, max_q=max(batch.num_tokens), max_k=int(lens.max()))

    def _to_device(self, a):
        """Two host-to-device copies (one int64, one int32 buffer) instead of nine; every
        array starts 16 bytes aligned, so the kernels see the same pointer alignment (and
        Triton compiles no new variant) whatever the step's sizes."""
        ids, kv_slots, rows, ph, ph_rows = _pack([a["ids"], a["kv_slots"], a["rows"], a["ph"], a["ph_rows"]],
                                                 np.int64, self.device)
        pos, cu, lens, tables = _pack([a["pos"], a["cu"], a["lens"], a["tables"].ravel()], np.int32, self.device)
        if len(ph):
            ids.index_copy_(0, ph, self._last_samples.index_select(0, ph_rows))
        return ids, pos, kv_slots, tables.view(len(a["lens"]), -1), cu, lens, rows

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
                self._dec.invalidate()  # the next decode step is no continuation of this one
            a = self.prepare(batch)
            ids, pos, kv_slots, tables, cu, lens, rows = self._to_device(a)
            h = self._hidden(ids, pos, kv_slots, tables, cu, lens, a["max_q"], a["max_k"], rows)
            if not len(a["rows"]):  # only non-final prefill chunks: nothing to sample
                return None, graph
            out = self._sample(h, self._sampling_tensors(batch))
        self._last_samples = out[0]
        return self._readback(out), graph

    def _readback(self, out):
        """Start the copy of a step's (tokens, logprobs) to pinned host memory, behind the
        step on the stream -> (tokens, logprobs, event) for `collect`. Waiting on the event
        rather than on `.tolist()` matters: `.tolist()` would also wait for every step
        enqueued after this one (the lookahead step), serialising host and device. Two
        buffers alternate: a step's copy is read (`collect`) before the launch after next."""
        if self.device.type != "cuda":  # copies: a graph's outputs are overwritten by the next replay
            return out[0].clone(), out[1].clone(), None
        return self._rb.start(out[0], out[1])

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
    def _dec_state(self) -> DecodeState:
        if self._dec is None:
            self._dec = DecodeState(self.max_num_seqs, math.ceil(self.max_model_len / self.block_size),
                                    self.block_size, self.device)
        return self._dec

    def _decode(self, batch: ScheduledBatch):
        """A pure decode step (one token, one sample per sequence): its fields onto the device
        (`DecodeState.load`: staged from the host, or continued on the device), then the model
        and the sampler (one CUDA graph when enabled) -> (tokens [S], logprobs [S])."""
        d, S = self._dec_state(), len(batch.seqs)
        if not self.use_graphs:
            max_k = d.load(batch, S, self._last_samples)
            W = max(-(-max_k // self.block_size), 1)
            cu = torch.arange(S + 1, device=self.device, dtype=torch.int32)
            v = d.dev
            h = self._hidden(v["ids"][:S], v["pos"][:S], v["kv_slots"][:S], d.block_tables(S, W), cu, v["lens"][:S],
                             1, max_k)
            return self._sample(h, d.sampling(S))
        if self.model.flat.data_ptr() != self._graph_flat_ptr or self._graph_exact != is_exact():
            # the weights moved, or exact mode was switched: the graphs hold other kernels
            self.graphs, self._static, self._pool = {}, None, None
            self._graph_flat_ptr = self.model.flat.data_ptr()
            self._graph_exact = is_exact()
        b = self._batch_bucket(S)
        max_k = d.load(batch, b, self._last_samples)
        key = self._graph_key(S, max_k)
        if key not in self.graphs:
            self._capture(*key)
        # the entries the kernel may read: those of the step's context bucket (a graph merged
        # into the max_model_len bucket reads no further, see _graph_key)
        W = math.ceil(context_bucket(max_k, self.max_model_len) / self.block_size)
        self._static["tables"][:b, :W] = d.block_tables(b, W)
        replay, (tokens, logprobs) = self.graphs[key]
        replay()
        return tokens[:S], logprobs[:S]

    # ------------------------------------------------------------------ KV pool, graphs
    def _auto_num_blocks(self, max_model_len: int) -> int:
        if self.device.type != "cuda":  # room for 4 longest sequences (or the token budget), at most 1 GiB
            want = -(-max(4 * max_model_len, self.max_num_batched_tokens) // self.block_size)
            return max(min(want, CPU_KV_BYTES // self.block_bytes), 1)
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        activations, graphs = self._probe_memory(max_model_len)
        self.memory_probe = {"activation_bytes": activations, "graph_bytes": graphs}
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        budget = total * self.gpu_memory_utilization - (total - free) - activations - graphs
        n = int(budget // self.block_bytes)
        if n < 1:
            gib = 1 << 30
            raise RuntimeError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} leaves no room for the KV cache: "
                f"{(total - free) / gib:.1f} GiB of {total / gib:.1f} GiB in use, {activations / gib:.2f} GiB "
                f"for activations, {graphs / gib:.2f} GiB for the decode graphs; raise gpu_memory_utilization, "
                "lower max_num_batched_tokens, or free memory")
        return n

    def _probe_memory(self, max_model_len: int) -> tuple[int, int]:
        """Peak memory of a step of the full token budget (its forward and sampling) and, with
        graphs, of the widest decode step (the graphs' private pool holds about that: the largest
        graph is captured first and the others reuse its memory), each over a one-block pool
        (nothing is written; attention reads block 0 again and again) -> (activation bytes,
        graph pool bytes)."""
        c, d = self.cfg, self.device
        self.kv = torch.zeros(2, c.num_hidden_layers, 1, self.block_size, c.num_key_value_heads, c.head_dim,
                              device=d, dtype=self.dtype)
        N = self.max_num_batched_tokens
        L = min(N, max_model_len)
        lens = [L] * (N // L) + ([N % L] if N % L else [])
        args, _ = warmup.prefill_inputs(lens, self.block_size, self.max_num_seqs, d)
        R = min(self.max_num_seqs, N)  # the most rows a step samples
        args = (*args[:-1], torch.full((R,), N - 1, device=d, dtype=torch.int64))
        peaks = []
        steps = [(args, R)]
        if self.use_graphs:
            kb = context_bucket(max_model_len, max_model_len)
            steps.append((warmup.decode_inputs(self.max_num_seqs, kb, self.block_size, d), self.max_num_seqs))
        for a, rows in steps:
            torch.cuda.synchronize(d)
            torch.cuda.reset_peak_memory_stats(d)
            before = torch.cuda.memory_allocated(d)
            out = self._sample(self._hidden(*a), warmup.sampling_inputs(rows, d))
            torch.cuda.synchronize(d)
            peaks.append(torch.cuda.max_memory_allocated(d) - before)
            del out
        self.kv = None
        return peaks[0], (peaks[1] if len(peaks) > 1 else 0)

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

    def _batch_bucket(self, S: int) -> int:
        """The graphs' batch size for S rows (rows S.. are padding rows)."""
        return next(b for b in graph_buckets(self.max_num_seqs) if b >= S)

    def _graph_key(self, S: int, max_k: int) -> tuple[int, int]:
        """(batch bucket, context bucket): the decode kernel's split count follows max_seqlen_k,
        so graphs are kept per context bucket (1k, 4k, 16k, ... up to max_model_len). A batch
        wide enough to run unsplit at its bucket and at max_model_len takes the max_model_len
        bucket: an unsplit step is the same kernel whatever the bucket (its one split covers
        any context), so one graph serves every context."""
        b = self._batch_bucket(S)
        kb = context_bucket(max_k, self.max_model_len)
        if kb < self.max_model_len and not is_exact() and self._unsplit(b, kb) and self._unsplit(b, self.max_model_len):
            kb = self.max_model_len
        return b, kb

    def _unsplit(self, b: int, kb: int) -> bool:
        # the split kernel with one split is the same launch at any bucket; the chunk kernel's
        # partials are sized by the bucket, so it keeps a graph per bucket
        plan = decode_plan(b, self.cfg.num_key_value_heads, kb, _num_sms(self.device))
        return plan["kernel"] == "split" and plan["splits"] == 1

    def graph_plan(self, max_context: int | None = None) -> list[tuple[int, int]]:
        """The graph keys of every batch bucket at every context bucket up to max_context
        (default: max_model_len), in capture order (warmup.graph_plan)."""
        mc = self.max_model_len if max_context is None else max_context
        return warmup.graph_plan(self.max_num_seqs, mc, self.max_model_len, self._graph_key)

    @torch.no_grad()
    def _capture(self, b: int, kb: int) -> None:
        d = self.device
        if self._static is None:
            max_bs, W = self.max_num_seqs, math.ceil(self.max_model_len / self.block_size)
            v = self._dec_state().dev  # ids, pos, kv slots, lens: filled by the decode step's one copy
            self._static = dict(
                ids=v["ids"], pos=v["pos"], kv_slots=v["kv_slots"], lens=v["lens"],
                tables=torch.zeros(max_bs, W, device=d, dtype=torch.int32),
                cu=torch.arange(max_bs + 1, device=d, dtype=torch.int32),
            )
            self._pool = torch.cuda.graph_pool_handle() if d.type == "cuda" else None
        st = self._static
        args = (st["ids"][:b], st["pos"][:b], st["kv_slots"][:b], st["tables"][:b], st["cu"][:b + 1], st["lens"][:b],
                1, kb)
        saved = {k: v.clone() for k, v in st.items() if k != "tables"}
        st["kv_slots"].fill_(-1)  # the warm-up and capture runs must write nowhere
        st["lens"].fill_(1)
        samp = self._dec_state().sampling(b)

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
        self.num_captures += 1
        torch.cuda.synchronize(self.device)
        return g.replay, out

    def capture_graphs(self, max_context: int) -> int:
        """Capture now (not on first use) the graphs of every batch bucket for the context
        buckets up to `max_context`; returns how many graphs exist."""
        if self.use_graphs and self.kv is not None:
            for key in self.graph_plan(max_context):
                if key not in self.graphs:
                    self._capture(*key)
        return len(self.graphs)

    def warm_up(self) -> dict:
        """Compile the kernels of every step kind and capture every decode graph now
        (engine/warmup.py) -> what it did."""
        return warmup.warm_up(self)
