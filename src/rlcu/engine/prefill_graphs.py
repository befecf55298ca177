"""The CUDA graphs of prefill and mixed steps: their token buckets, their fields on the device,
their capture and their replay.

A step with prefill chunks launches about ten kernels a layer whatever its size; eagerly its
host time is longer than its kernels take on the device, even at a full budget of tokens, so
the device waits (bench/prefill.py, bench/results/prefill.json). A graph launches the step's trunk (the embedding to
the final norm of every token) at once; the sampled rows' LM head and the sampler then run
eagerly on exactly those rows (a few launches), so a graph serves any number of rows. Steps
of up to `budget` new tokens and `max_seqs` sequences replay the graph of the smallest token
bucket that holds them (`token_buckets`: 256, 512, then multiples of budget / 8, and the
budget itself, so padding adds at most an eighth of a full step); the rest (more sequences,
exact mode, one query token a sequence) run eagerly.

Every field of a step lives at a fixed offset of one byte buffer on the device (`_layout`),
sized for the largest bucket; the host fills one of two pinned staging copies (the host runs
one step ahead of the device) and sends it with one non-blocking copy, up to the block-table
rows the step uses (the sampled rows' indices too, which the runner's head then selects).
Padding writes nowhere and computes nothing that is read:
- tokens N .. bucket: id 0 at position 0, kv slot -1 (no write), in no sequence, no adapter;
- sequences S .. max_seqs: no query tokens (cu_q stays at N), context 0;
- the attention's tile list (ops/paged_attention.py `prefill_tiles`): entries past the step's
  tiles exit at once, so the grid is fixed while the work follows the step.
Placeholder tokens (sampled by the step before, still on the device) are copied into the ids
on the device before the replay, outside the graph.

The warm-up captures every bucket at the engine's start; after a drop (a sleep, moved
weights), a bucket is captured again the second time a step needs it (`take`).

The graphs hold the addresses they were captured on (`GraphSet`, engine/graphs.py: the
weights, the exact mode, the KV pool) and a private memory pool of about one full-budget
step's activations and every smaller bucket's output (`kept_output_rows`; kv_pool.py sets it
aside when it sizes the KV pool).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from rlcu.engine.graphs import GraphSet
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


def kept_output_rows(budget: int) -> int:
    """The rows of hidden states the graphs keep as their outputs beside the largest bucket's
    step (each bucket's graph owns its output in the pool; the memory model, rlcu.memory)."""
    return sum(token_buckets(budget)[:-1])


class PrefillGraphs(GraphSet):
    """The prefill graphs of one runner (see the module docstring)."""

    I64 = ("ids", "kv_slots", "rows", "ph", "ph_rows")
    I32 = ("pos", "cu", "lens", "tile_seq", "tile_idx", "lora", "tables")  # lora: each token's adapter slot

    def __init__(self, *, budget: int, max_seqs: int, max_model_len: int, block_size: int, num_heads: int,
                 num_kv_heads: int, device: torch.device, weights_ptr: int, exact: bool = False):
        super().__init__(device, weights_ptr, exact)
        self.budget, self.max_seqs = budget, max_seqs
        self.width = math.ceil(max_model_len / block_size)  # block-table entries a sequence
        self.heads = (num_heads, num_kv_heads)
        self.buckets = token_buckets(budget)
        self.tile_cap = {b: prefill_tiles_cap(b, max_seqs, *self.heads) for b in self.buckets}
        self.sizes = dict(ids=budget, kv_slots=budget, pos=budget, lora=budget, rows=max_seqs, ph=max_seqs,
                          ph_rows=max_seqs, cu=max_seqs + 1, lens=max_seqs,
                          tile_seq=self.tile_cap[budget], tile_idx=self.tile_cap[budget],
                          tables=max_seqs * self.width)
        self.offsets, self.nbytes = self._layout()
        self._host: list | None = None  # two pinned staging copies: (bytes, views, event)
        self._turn = 0
        self.seen: set[int] = set()  # buckets run eagerly once since the graphs were dropped

    def drop(self) -> None:
        super().drop()
        self.seen = set()

    def _layout(self) -> tuple[dict, int]:
        """Each field's (byte offset, item size), 16-byte aligned (Triton specialises pointers on
        it), the block tables last (a step sends only the rows it uses) -> (offsets, bytes)."""
        out, off = {}, 0
        for names, size in ((self.I64, 8), (self.I32, 4)):
            for n in names:
                if n != "tables":
                    out[n] = (off, size)
                    off += -(-self.sizes[n] * size // 16) * 16
        out["tables"] = (off, 4)
        return out, off + 4 * self.sizes["tables"]

    def _views(self, buf) -> dict:
        dt = {8: np.int64, 4: np.int32} if isinstance(buf, np.ndarray) else {8: torch.int64, 4: torch.int32}
        out = {}
        for n, (off, size) in self.offsets.items():
            out[n] = buf[off:off + size * self.sizes[n]].view(dt[size])
        out["tables"] = out["tables"].reshape(self.max_seqs, self.width)
        return out

    # ------------------------------------------------------------------ which steps
    def bucket(self, a: dict, exact: bool) -> int | None:
        """The token bucket of a prepared step (ModelRunner.prepare's arrays), or None when it
        runs eagerly (in exact mode, the model's `exact`; one query token a sequence; more
        sequences than the graphs hold)."""
        N, S = len(a["ids"]), len(a["lens"])
        if exact or a["max_q"] <= 1 or N > self.budget or S > self.max_seqs:
            return None
        if max(len(a["ph"]), len(a["rows"])) > self.max_seqs or a["tables"].shape[1] > self.width:
            return None
        return next(b for b in self.buckets if b >= N)

    def take(self, b: int) -> bool:
        """Whether a step of bucket b runs by its graph now: yes when the graph exists; else the
        first step of the bucket since the graphs were dropped runs eagerly and the second one
        captures it. An RL loop's sleep drops the graphs every step (their pool is training's
        memory), so its one prefill step a rollout runs eagerly instead of paying a capture
        (a warm-up run and the capture) for one replay; the engine's warm-up captures every
        bucket at once."""
        if b in self.graphs or b in self.seen:
            return True
        self.seen.add(b)
        return False

    # ------------------------------------------------------------------ the fields
    def _static_fields(self) -> dict:
        """The step's fields on the device (the graphs read these), and "bytes": their buffer."""
        if self._static is None:
            buf = torch.zeros(self.nbytes, device=self.device, dtype=torch.uint8)
            self._static = {**self._views(buf), "bytes": buf}
        return self._static

    def _staging(self) -> tuple:
        """The next pinned staging copy (bytes, fields, event), once the device has read it
        (two alternate: the device read this one two sends ago)."""
        if self._host is None:
            cuda = self.device.type == "cuda"
            bufs = [torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
            self._host = [(b, self._views(b.numpy()), torch.cuda.Event() if cuda else None) for b in bufs]
        k, self._turn = self._turn, self._turn ^ 1
        if self._host[k][2] is not None:
            self._host[k][2].synchronize()
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
        return (v["ids"][:b], v["pos"][:b], v["kv_slots"][:b], v["tables"], v["cu"], v["lens"], b, b, None,
                (v["tile_seq"][:T], v["tile_idx"][:T]))

    @staticmethod
    def _pad(h: dict, N: int, S: int, T: int) -> None:
        """Host fields past a step's N tokens, S sequences, T tiles: padding."""
        h["ids"][N:] = 0
        h["pos"][N:] = 0
        h["kv_slots"][N:] = -1
        h["lora"][N:] = -1
        h["cu"][S + 1:] = N
        h["lens"][S:] = 0
        h["tile_seq"][T:] = -1
        h["tile_idx"][T:] = 0

    def load(self, a: dict, last_samples: torch.Tensor | None) -> None:
        """Put a prepared step's fields on the device, padded; then its placeholder tokens from
        last_samples (the previous launch's samples on the device)."""
        host = self._staging()
        h = host[1]
        N, S, T, P = len(a["ids"]), len(a["lens"]), len(a["tile_seq"]), len(a["ph"])
        for n in ("ids", "kv_slots", "pos", "cu", "lens", "tile_seq", "tile_idx", "rows", "ph", "ph_rows", "lora"):
            h[n][:len(a[n])] = a[n]
        width = a["tables"].shape[1]
        h["tables"][:S, :width] = a["tables"]
        self._pad(h, N, S, T)
        self._send(host, self.offsets["tables"][0] + 4 * S * self.width)
        if P:
            dev = self._static_fields()
            dev["ids"].index_copy_(0, dev["ph"][:P], last_samples.index_select(0, dev["ph_rows"][:P]))

    # ------------------------------------------------------------------ capture, replay
    @torch.no_grad()
    def capture(self, b: int, trunk) -> None:
        """Capture bucket b's graph of `trunk(*args, lora_idx=)` (the runner's `_hidden`; lora_idx
        its tokens' adapter slots, a field like the others): the step's
        fields all padding (nothing written, nothing attended), run once before the capture
        (the kernels' compiles)."""
        host = self._staging()
        self._pad(host[1], 0, 0, 0)
        self._send(host, self.nbytes)
        args, lora = self._args(b), self._static_fields()["lora"][:b]

        def run():
            return trunk(*args, lora_idx=lora)

        run()
        self.graphs[b] = self._record(run)

    def capture_all(self, trunk) -> None:
        """Capture every bucket's graph not captured yet, largest first (the smaller ones reuse
        its pool's memory)."""
        for b in sorted(self.buckets, reverse=True):
            if b not in self.graphs:
                self.capture(b, trunk)

    def replay(self, a: dict, b: int, last_samples: torch.Tensor | None, trunk) -> torch.Tensor:
        """Run a prepared step's trunk by bucket b's graph (captured now if missing) -> the
        final-normed hidden states of its N tokens [N, hidden] (a view of the graph's output,
        valid until the next replay)."""
        if b not in self.graphs:
            self.capture(b, trunk)
        self.load(a, last_samples)
        replay, h = self.graphs[b]
        replay()
        return h[:len(a["ids"])]

    def sampled_rows(self, R: int) -> torch.Tensor:
        """The last loaded step's R sampled rows (indices into its tokens), on the device: sent
        with its other fields."""
        return self._static_fields()["rows"][:R]
