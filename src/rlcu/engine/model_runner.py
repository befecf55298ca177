"""Runs the model over the scheduler's packed batch: prepares the tensors, launches the step,
reads its samples back. It holds the step's parts, each owned by its own module:
- the forward over the paged cache, the LM head and the sampler: engine/paged_forward.py;
- the KV pool (its size, allocation, release): engine/kv_pool.py;
- the CUDA graphs of the pure decode steps: engine/graphs.py (`DecodeGraphs`);
- the pure decode steps' fields on the device: engine/decode_state.py (`DecodeState`);
- the CUDA graphs of prefill and mixed steps, and their fields: engine/prefill_graphs.py;
- a Qwen3-MoE model's route log (engine/routes.py `RouteLog`, with the pool): every step's
  experts by kv slot, copied out for a sequence as it retires (`keep_routes`);
- the LoRA adapters it serves (`lora`, engine/lora.py `LoraSlots`, or None): each step passes
  the slots with its per-token slot index (`Sequence.lora` repeated over the sequence's chunk;
  in the decode and prefill graphs' static fields, so that a replay takes new adapters).
With graphs, the steps the graphs do not hold run eagerly (exact mode's prefill, steps wider
than the graphs). `allocate` and `release` keep the stateful ones in step (the pool's
address, the graphs kept or dropped, the decode state reset or dropped).

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

from rlcu.engine import kv_pool, paged_forward, warmup
from rlcu.engine.decode_state import DecodeState
from rlcu.engine.graphs import DecodeGraphs
from rlcu.engine.prefill_graphs import PrefillGraphs
from rlcu.engine.routes import RouteLog, sequence_slots
from rlcu.engine.scheduler import ScheduledBatch
from rlcu.model.causal_lm import Qwen3
from rlcu.ops.paged_attention import prefill_tiles


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
                 enforce_eager: bool = False, prefill_graphs: bool = True):
        self.model = model
        c = self.cfg = model.cfg
        self.device, self.dtype = model.device, model.dtype
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.gpu_memory_utilization = gpu_memory_utilization
        self.use_graphs = self.device.type == "cuda" and not enforce_eager
        self.use_prefill_graphs = prefill_graphs  # and use_graphs (which tests may switch on for the CPU)
        self.block_bytes = kv_pool.block_bytes(c, block_size, self.dtype)
        self.memory_probe: dict = {}  # what the pool's sizing set aside (kv_pool.auto_num_blocks)
        if num_kv_blocks is None:
            num_kv_blocks, self.memory_probe = kv_pool.auto_num_blocks(
                model, block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization, graphs=self.use_graphs,
                prefill_graphs=self.use_graphs and prefill_graphs)
        self.num_blocks = num_kv_blocks
        self.max_model_len = min(max_model_len, self.num_blocks * block_size)
        self.kv: torch.Tensor | None = None  # the KV pool (engine/kv_pool.py); None while released
        self.routes: RouteLog | None = None  # a MoE model's experts by kv slot (engine/routes.py), with kv
        self.decode_graphs = DecodeGraphs(max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                          block_size=block_size, num_kv_heads=c.num_key_value_heads,
                                          device=self.device, weights_ptr=model.flat.data_ptr(), exact=model.exact)
        self.prefill_graphs = PrefillGraphs(budget=max_num_batched_tokens, max_seqs=max_num_seqs,
                                            max_model_len=self.max_model_len, block_size=block_size,
                                            num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                                            device=self.device, weights_ptr=model.flat.data_ptr(),
                                            exact=model.exact)
        self._last_samples: torch.Tensor | None = None  # the tokens sampled by the last launch (placeholders' values)
        self._dec: DecodeState | None = None  # everything of the pure decode steps (engine/decode_state.py)
        self._rb = _Readback(max_num_seqs)  # pinned host buffers of the samples (see _readback)
        self.lora = None  # engine/lora.py LoraSlots (set_lora), or None: no adapters
        self.allocate()

    def set_lora(self, slots) -> None:
        """Serve the adapters `slots` (engine/lora.py LoraSlots, or None). The graphs hold the
        slots' addresses and, with adapters, another schedule: they are dropped when the slots
        change."""
        if slots is not self.lora:
            self.lora = slots
            self.decode_graphs.drop()
            self.prefill_graphs.drop()

    def memory_shape(self):
        """This engine as the memory model sees it (kv_pool.engine_shape: a JobShape without
        an optimizer, its `engine` this runner's pool, steps and graphs)."""
        return kv_pool.engine_shape(self.cfg, self.dtype, kv_tokens=self.num_blocks * self.block_size,
                                    max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                    graphs=self.use_graphs, prefill_graphs=self.use_prefill_graphs)

    @property
    def num_continued(self) -> int:
        """Decode steps that continued the one before on the device, since the decode state was
        made (a release without keep_graphs drops it)."""
        return self._dec.num_continued if self._dec is not None else 0

    @property
    def graphs(self) -> dict[tuple[int, int], tuple]:
        """The decode graphs captured: (batch bucket, context bucket) -> (replay, outputs)."""
        return self.decode_graphs.graphs

    @property
    def num_captures(self) -> int:
        """CUDA graphs captured by this runner, ever."""
        return self.decode_graphs.num_captures

    @property
    def graph_wakes(self) -> dict[str, int]:
        """Wakes after release(keep_graphs=True): {"kept", "recaptured"}."""
        return self.decode_graphs.wakes

    # ------------------------------------------------------------------ the forward
    def _hidden(self, *args, lora_idx=None) -> torch.Tensor:
        """paged_forward.hidden over this runner's model, KV pool and adapters (args: see there;
        lora_idx: each token's adapter slot, int32 [N], -1 for none; None with adapters: slot 0,
        the warm-up's dummy steps, which run every kernel a step with adapters runs)."""
        lora = None
        if self.lora is not None:
            if lora_idx is None:
                lora_idx = torch.zeros(args[0].shape[0], device=self.device, dtype=torch.int32)
            lora = self.lora.step(lora_idx)
        return paged_forward.hidden(self.model, self.kv, *args, lora=lora, routes=self.routes)

    def _sample(self, h: torch.Tensor, samp: tuple):
        """paged_forward.sample_rows: the LM head and the sampler -> (tokens, logprobs)."""
        return paged_forward.sample_rows(self.model, h, samp)

    def _graph_step(self, args: tuple, samp: tuple):
        """The step a decode graph captures (engine/graphs.py): the forward and the sampler
        (its rows' adapter slots: the decode state's field, which the graphs read)."""
        return self._sample(self._hidden(*args, lora_idx=self._dec_state().dev["lora"][:args[0].shape[0]]), samp)

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
        c = self.cfg
        tile_seq, tile_idx = prefill_tiles(batch.num_tokens, c.num_attention_heads, c.num_key_value_heads,
                                           ctx_lens=lens)
        lora = np.repeat(np.array([s.lora for s in seqs], dtype=np.int32), take)  # each token's adapter slot
        return dict(ids=ids, pos=pos, kv_slots=kv_slots, tables=tables, cu=cu, lens=lens, rows=rows, ph=ph, lora=lora,
                    ph_rows=ph_rows, tile_seq=tile_seq, tile_idx=tile_idx, max_q=max(batch.num_tokens),
                    max_k=int(lens.max()))

    def _to_device(self, a):
        """Two host-to-device copies (one int64, one int32 buffer) instead of eleven; every
        array starts 16 bytes aligned, so the kernels see the same pointer alignment (and
        Triton compiles no new variant) whatever the step's sizes -> `_hidden`'s arguments."""
        ids, kv_slots, rows, ph, ph_rows = _pack([a["ids"], a["kv_slots"], a["rows"], a["ph"], a["ph_rows"]],
                                                 np.int64, self.device)
        pos, cu, lens, tables, ts, ti, lora = _pack([a["pos"], a["cu"], a["lens"], a["tables"].ravel(), a["tile_seq"],
                                                     a["tile_idx"], a["lora"]], np.int32, self.device)
        if len(ph):
            ids.index_copy_(0, ph, self._last_samples.index_select(0, ph_rows))
        return (ids, pos, kv_slots, tables.view(len(a["lens"]), -1), cu, lens, a["max_q"], a["max_k"], rows,
                (ts, ti)), lora

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
            if self.routes is not None:
                self.routes.copy_blocks(idx[0], idx[1], self.block_size)
        if batch.is_decode and len(batch.seqs) <= self.max_num_seqs:
            graph = self.use_graphs
            out = self._decode(batch)
        else:
            graph = False
            if self._dec is not None:
                self._dec.invalidate()  # the next decode step is no continuation of this one
            a = self.prepare(batch)
            b = self._prefill_bucket(a)
            if b is not None:  # the trunk by its graph (every token), then the sampled rows
                graph = True
                h = self.prefill_graphs.replay(a, b, self._last_samples, self._hidden)
                if len(a["rows"]):
                    h = h.index_select(0, self.prefill_graphs.sampled_rows(len(a["rows"])))
            else:
                args, lora = self._to_device(a)
                h = self._hidden(*args, lora_idx=lora)
            if not len(a["rows"]):  # only non-final prefill chunks: nothing to sample
                return None, graph
            out = self._sample(h, self._sampling_tensors(batch))
        self._last_samples = out[0]
        return self._readback(out), graph

    def _prefill_bucket(self, a: dict) -> int | None:
        """The prefill graph's token bucket a prepared step runs by, or None (eagerly)."""
        pg = self.prefill_graphs
        b = pg.bucket(a, self.model.exact) if self.use_graphs and self.use_prefill_graphs else None
        if b is None:
            return None
        self._follow(pg)
        return b if pg.take(b) else None

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
                             1, max_k, lora_idx=v["lora"][:S])
            return self._sample(h, d.sampling(S))
        g = self.decode_graphs
        self._follow(g)
        max_k = d.load(batch, g.batch_bucket(S), self._last_samples)
        return g.replay(S, max_k, d, self._graph_step)

    # ------------------------------------------------------------------ KV pool, graphs
    def allocate(self) -> None:
        """Take the KV pool (graphs are captured on first use). Graphs kept through a
        `release(keep_graphs=True)` stay only if the new pool sits at the old address (the
        graphs hold its addresses); else they are dropped and captured again."""
        if self.kv is None:
            self.kv = kv_pool.new_pool(self.cfg, self.num_blocks, self.block_size, self.device, self.dtype)
            if self.cfg.fam.moe:
                self.routes = RouteLog(self.cfg, self.num_blocks * self.block_size, self.device)
            self.decode_graphs.rebind(self._pool_key())
            self.prefill_graphs.rebind(self._pool_key())

    def _pool_key(self) -> tuple[int, int]:
        """The addresses graphs hold of the pool's tensors: the KV pool's and the route log's."""
        return self.kv.data_ptr(), (self.routes.buf.data_ptr() if self.routes is not None else 0)

    def keep_routes(self, seq) -> None:
        """A retiring sequence's routes, copied out of the log before its blocks are freed: `seq.routes`
        [n, Ls, k] on the device, n = its tokens but the last (the rows the engine computed)."""
        if self.routes is not None:
            n = len(seq.token_ids) - 1
            seq.routes = self.routes.gather(sequence_slots(seq.block_table, self.block_size, n))

    def release(self, keep_graphs: bool = False) -> None:
        """Give the KV pool, and unless keep_graphs the graphs, back to the allocator (and the
        device). Kept graphs hold their memory pool (the activations of one decode step per
        batch bucket: tens of MB, against GBs of KV). The prefill graphs are dropped either way:
        their pool is about one full-budget step's activations (hundreds of MB at 0.6B, GBs at
        8B), which a trainer sharing the device wants; a bucket is captured again on the second
        step that needs it (`PrefillGraphs.take`)."""
        if keep_graphs and self.graphs and self.kv is not None:
            self.decode_graphs.keep(self._pool_key())
            self._dec.reset()
        else:
            self.decode_graphs.drop()
            self._dec = None
        self.prefill_graphs.drop()  # always: its pool is a full step's activations, which training wants
        self.kv = self.routes = None
        kv_pool.give_back(self.device)

    def graph_plan(self, max_context: int | None = None) -> list[tuple[int, int]]:
        """The graph keys of every batch bucket at every context bucket up to max_context
        (default: max_model_len), in capture order (DecodeGraphs.plan)."""
        return self.decode_graphs.plan(max_context)

    def capture_graphs(self, max_context: int) -> int:
        """Capture now (not on first use) the graphs of every batch bucket for the context
        buckets up to `max_context`; returns how many graphs exist."""
        if self.use_graphs and self.kv is not None:
            self._follow(self.decode_graphs)
            self.decode_graphs.capture_all(max_context, self._dec_state(), self._graph_step)
        return len(self.graphs)

    def capture_prefill_graphs(self) -> int:
        """Capture now (not on first use) the prefill graphs of every token bucket (none in
        exact mode, whose prefill runs eagerly); returns how many exist."""
        if self.use_graphs and self.use_prefill_graphs and self.kv is not None and not self.model.exact:
            self._follow(self.prefill_graphs)
            self.prefill_graphs.capture_all(self._hidden)
        return len(self.prefill_graphs.graphs)

    def _follow(self, graphs) -> None:
        """Drop `graphs` (a GraphSet) if the weights moved or the model's exact mode was switched
        since they were captured."""
        graphs.follow(self.model.flat.data_ptr(), self.model.exact)

    def warm_up(self) -> dict:
        """Compile the kernels of every step kind and capture every decode graph now
        (engine/warmup.py) -> what it did."""
        return warmup.warm_up(self)
