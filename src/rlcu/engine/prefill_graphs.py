"""The CUDA graphs of prefill and mixed steps: their token buckets, their fields on the device,
their capture and their replay.

A step with prefill chunks launches about ten kernels a layer whatever its size; eagerly that
is ~20 ms of host time a step at 0.6B, longer than the 17 ms its kernels of 8192 tokens take,
so the device waits (bench/prefill.py). A graph launches the whole step (embedding to the
sampled tokens) at once. Steps of up to `budget` new tokens, `max_seqs` sequences and
`max_rows` sampled rows replay the graph of the smallest token bucket that holds them
(`token_buckets`: 256, 512, then multiples of budget / 8, and the budget itself, so padding
adds at most an eighth of a full step); the rest (more sequences or rows, exact mode, one
query token a sequence) run eagerly.

Every field of a step lives at a fixed offset of one byte buffer on the device (`_layout`),
sized for the largest bucket; the host fills one of two pinned staging copies (the host runs
one step ahead of the device) and sends it with one non-blocking copy, up to the block-table
rows the step uses. Padding writes nowhere and computes nothing that is read:
- tokens N .. bucket: id 0 at position 0, kv slot -1 (no write), in no sequence;
- sequences S .. max_seqs: no query tokens (cu_q stays at N), context 0;
- the attention's tile list (ops/paged_attention.py `prefill_tiles`): entries past the step's
  tiles exit at once, so the grid is fixed while the work follows the step;
- rows R .. max_rows: sample token 0's logits at temperature 1; their samples are not read.
Placeholder tokens (sampled by the step before, still on the device) are copied into the ids
on the device before the replay, outside the graph.

The graphs hold the addresses they were captured on (`GraphSet`, engine/graphs.py: the
weights, the exact mode, the KV pool) and a private memory pool of about one full-budget
step's activations (kv_pool.py counts it when it sizes the KV pool).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from rlcu.engine.graphs import GraphSet
from rlcu.ops.exact import is_exact
from rlcu.ops.paged_attention import prefill_tiles_cap

BUCKET0 = 256  # the smallest token bucket


def token_buckets(budget: int) -> list[int]:
    """The graphs' token counts: powers of two from 256 below budget / 8 (rounded up to a
    multiple of 256), then multiples of that, and the budget; a step pads to the next one."""
    stride = max(BUCKET0, -(-budget // 8 // BUCKET0) * BUCKET0)
    small, b = [], BUCKET0
    while b < min(stride, budget):
        small.append(b)
        b *= 2
    return small + list(range(stride, budget, stride)) + [budget]


class PrefillGraphs(GraphSet):
    """The prefill graphs of one runner (see the module docstring)."""

    I64 = ("ids", "kv_slots", "rows", "seeds", "offsets", "ph", "ph_rows")
    I32 = ("pos", "cu", "lens", "tile_seq", "tile_idx", "top_k", "tables")
    F32 = ("temp", "top_p", "min_p")

    def __init__(self, *, budget: int, max_seqs: int, max_rows: int, max_model_len: int, block_size: int,
                 num_heads: int, num_kv_heads: int, device: torch.device, weights_ptr: int):
        super().__init__(device, weights_ptr)
        self.budget, self.max_seqs, self.max_rows = budget, max_seqs, max_rows
        self.width = math.ceil(max_model_len / block_size)  # block-table entries a sequence
        self.heads = (num_heads, num_kv_heads)
        self.buckets = token_buckets(budget)
        self.tile_cap = {b: prefill_tiles_cap(b, max_seqs, *self.heads) for b in self.buckets}
        self.sizes = dict(ids=budget, kv_slots=budget, pos=budget, rows=max_rows, seeds=max_rows,
                          offsets=max_rows, top_k=max_rows, temp=max_rows, top_p=max_rows, min_p=max_rows,
                          ph=max_seqs, ph_rows=max_seqs, cu=max_seqs + 1, lens=max_seqs,
                          tile_seq=self.tile_cap[budget], tile_idx=self.tile_cap[budget],
                          tables=max_seqs * self.width)
        self.offsets, self.nbytes = self._layout()
        self._host: list | None = None  # two pinned staging copies: (bytes, views, event)
        self._turn = 0

    def _layout(self) -> tuple[dict, int]:
        """Each field's (byte offset, item size), 16-byte aligned (Triton specialises pointers on
        it), the block tables last (a step sends only the rows it uses) -> (offsets, bytes)."""
        out, off = {}, 0
        for names, size in ((self.I64, 8), (self.I32, 4), (self.F32, 4)):
            for n in names:
                if n != "tables":
                    out[n] = (off, size)
                    off += -(-self.sizes[n] * size // 16) * 16
        out["tables"] = (off, 4)
        return out, off + 4 * self.sizes["tables"]

    def _views(self, buf) -> dict:
        dt = {8: np.int64, 4: np.int32} if isinstance(buf, np.ndarray) else {8: torch.int64, 4: torch.int32}
        fdt = np.float32 if isinstance(buf, np.ndarray) else torch.float32
        out = {}
        for n, (off, size) in self.offsets.items():
            raw = buf[off:off + size * self.sizes[n]]
            out[n] = raw.view(fdt if n in self.F32 else dt[size])
        out["tables"] = out["tables"].reshape(self.max_seqs, self.width)
        return out

    # ------------------------------------------------------------------ which steps
    def bucket(self, a: dict) -> int | None:
        """The token bucket of a prepared step (ModelRunner.prepare's arrays), or None when it
        runs eagerly (exact mode, one query token a sequence, more sequences or rows than the
        graphs hold)."""
        N, S, R = len(a["ids"]), len(a["lens"]), len(a["rows"])
        if is_exact() or a["max_q"] <= 1 or N > self.budget or S > self.max_seqs or R > self.max_rows:
            return None
        if len(a["ph"]) > self.max_seqs or a["tables"].shape[1] > self.width:
            return None
        return next(b for b in self.buckets if b >= N)

    # ------------------------------------------------------------------ the fields
    def _static_fields(self) -> dict:
        """The step's fields on the device (the graphs read these), and "bytes": their buffer."""
        if self._static is None:
            buf = torch.zeros(self.nbytes, device=self.device, dtype=torch.uint8)
            self._static = {**self._views(buf), "bytes": buf}
        return self._static

    def _staging(self) -> tuple:
        """The next pinned staging copy (bytes, fields, event), once the device has read it
        (two alternate)."""
        if self._host is None:
            cuda = self.device.type == "cuda"
            bufs = [torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
            self._host = [(b, self._views(b.numpy()), torch.cuda.Event() if cuda else None) for b in bufs]
        k, self._turn = self._turn, self._turn ^ 1
        return self._host[k]

    def _send(self, host: tuple, end: int) -> None:
        """Copy the first `end` bytes of a staging copy to the device fields, behind the work
        enqueued so far; its event marks when the staging copy may be filled again."""
        raw, _, ev = host
        self._static_fields()["bytes"][:end].copy_(raw[:end], non_blocking=True)
        if ev is not None:
            ev.record()

    def _args(self, b: int) -> tuple:
        """`_hidden`'s arguments for bucket b, views of the device fields."""
        v, T = self._static_fields(), self.tile_cap[b]
        return (v["ids"][:b], v["pos"][:b], v["kv_slots"][:b], v["tables"], v["cu"], v["lens"], b, b,
                v["rows"], (v["tile_seq"][:T], v["tile_idx"][:T]))

    def _samp(self) -> tuple:
        v = self._static_fields()
        return v["temp"], v["top_k"], v["top_p"], v["min_p"], v["seeds"], v["offsets"]

    @staticmethod
    def _pad(h: dict, N: int, S: int, R: int, T: int) -> None:
        """Host fields past a step's N tokens, S sequences, R rows, T tiles: padding."""
        h["ids"][N:] = 0
        h["pos"][N:] = 0
        h["kv_slots"][N:] = -1
        h["cu"][S + 1:] = N
        h["lens"][S:] = 0
        h["tile_seq"][T:] = -1
        h["tile_idx"][T:] = 0
        h["rows"][R:] = 0
        h["temp"][R:] = 1.0
        h["top_k"][R:] = 0
        h["top_p"][R:] = 1.0
        h["min_p"][R:] = 0.0
        h["seeds"][R:] = 0
        h["offsets"][R:] = 0

    def load(self, a: dict, samp: tuple | None, last_samples: torch.Tensor | None) -> None:
        """Put a prepared step's fields (and its sampler's rows, `samp`: (floats [3, R],
        ints [3, R]) or None without rows) on the device, padded; then its placeholder tokens
        from last_samples (the previous launch's samples on the device)."""
        host = self._staging()
        h = host[1]
        if host[2] is not None:
            host[2].synchronize()  # the device has read this copy (two steps ago)
        N, S, R, T = len(a["ids"]), len(a["lens"]), len(a["rows"]), len(a["tile_seq"])
        P = len(a["ph"])
        for n in ("ids", "kv_slots", "rows", "pos", "cu", "lens", "tile_seq", "tile_idx", "ph", "ph_rows"):
            h[n][:len(a[n])] = a[n]
        if R:
            fl, il = samp
            h["temp"][:R], h["top_p"][:R], h["min_p"][:R] = fl
            h["top_k"][:R], h["seeds"][:R], h["offsets"][:R] = il
        width = a["tables"].shape[1]
        h["tables"][:S, :width] = a["tables"]
        self._pad(h, N, S, R, T)
        self._send(host, self.offsets["tables"][0] + 4 * S * self.width)
        if P:
            dev = self._static_fields()
            dev["ids"].index_copy_(0, dev["ph"][:P], last_samples.index_select(0, dev["ph_rows"][:P]))

    # ------------------------------------------------------------------ capture, replay
    @torch.no_grad()
    def capture(self, b: int, step) -> None:
        """Capture bucket b's graph: the step's fields all padding (nothing written, nothing
        attended), the kernels run once before the capture (their compiles)."""
        host = self._staging()
        if host[2] is not None:
            host[2].synchronize()
        self._pad(host[1], 0, 0, 0, 0)
        self._send(host, self.nbytes)
        args, samp = self._args(b), self._samp()

        def run():
            return step(args, samp)

        run()
        self.graphs[b] = self._record(run)

    def capture_all(self, step) -> None:
        """Capture every bucket's graph not captured yet, largest first (the smaller ones reuse
        its pool's memory)."""
        for b in sorted(self.buckets, reverse=True):
            if b not in self.graphs:
                self.capture(b, step)

    def replay(self, a: dict, samp: tuple | None, b: int, last_samples: torch.Tensor | None, step):
        """Run a prepared step by bucket b's graph (captured now if missing) -> (tokens [R],
        logprobs [R]) of its R sampled rows (views of the graph's outputs)."""
        if b not in self.graphs:
            self.capture(b, step)
        self.load(a, samp, last_samples)
        replay, (tokens, logprobs) = self.graphs[b]
        replay()
        R = len(a["rows"])
        return tokens[:R], logprobs[:R]
