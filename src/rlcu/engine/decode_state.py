"""The state of the engine's pure decode steps (one token and one sample per sequence), owned
in one place: `DecodeState`.

Names, one meaning each:
  row      one sequence's place in a step (row i of the batch, row i of its samples);
  table    one of the block tables kept on the device (`tables[t]`); a sequence keeps its
           table while it decodes (`table_of`), the step's field `table` gives each row's;
  kv slot  a token's place in the KV pool: block * block_size + offset in the block.

Every field of a step (ids, positions, kv slots, context lengths, the sampler's parameters,
each row's table) lives at a fixed offset of one byte buffer on the device. The host fills
one of two pinned staging copies (double-buffered: the host runs one step ahead of the
device) and sends it with ONE non-blocking copy, followed by the step's variable part
(table entries that changed, placeholder rows). A table sends only the entries that changed:
the blocks appended since the last step, and the last block when copy-on-write replaced it
(BlockManager.reserve changes a block table only there).

The three operations:
  load(batch, pad_to, last_samples)  the step's fields onto the device: when the batch
      continues the last one (`ScheduledBatch.continues`), the device advances its own copy
      (token = the last step's sample of the row, position, context length and sample offset
      + 1, kv slot from the row's table) and the host sends only the changed table entries;
      else one pass over the rows stages every field from the host;
  invalidate()  the next step is no continuation (a step of another kind ran);
  reset()       forget which sequence holds which table (every sequence was preempted).
"""

from __future__ import annotations

import numpy as np
import torch

from rlcu.engine.scheduler import ScheduledBatch


class DecodeState:
    """Host and device buffers of pure decode steps of up to `rows` rows, reused every step,
    with block tables of `width` entries (see the module docstring)."""

    I64 = ("ids", "kv_slots", "seeds", "offsets", "table")
    I32 = ("pos", "lens", "top_k", "lora")  # lora: the row's adapter slot (-1: none), engine/lora.py
    F32 = ("temp", "top_p", "min_p")
    VAR_CAP = 1 << 16  # int64 entries of the variable part that travel in the staging copy

    def __init__(self, rows: int, width: int, block_size: int, device: torch.device):
        self.rows, self.width, self.block_size, self.device = rows, width, block_size, device
        self.num_tables = 2 * rows  # table num_tables: a zero table for padding rows
        self.tables = torch.zeros(self.num_tables + 1, width, device=device, dtype=torch.int32)
        self.table_of: dict[int, int] = {}  # seq_id -> table
        self.free = list(range(self.num_tables - 1, -1, -1))
        self.sent_list: list = [None] * self.num_tables  # the block-table list whose entries the table holds
        self.sent_n = [0] * self.num_tables  # entries sent
        self.sent_last = [0] * self.num_tables  # the value of the last entry sent
        self.offsets, off = {}, 0
        for names, size in ((self.I64, 8), (self.I32, 4), (self.F32, 4)):
            for n in names:
                self.offsets[n] = (off, size)
                off += -(-rows * size // 16) * 16  # 16-byte aligned: Triton specialises pointers on it
        self.fixed = off
        self.var_cap = self.VAR_CAP
        pin = device.type == "cuda"
        self.dbuf = torch.zeros(off + 8 * self.var_cap, device=device, dtype=torch.uint8)
        self.hbufs = [torch.zeros(off + 8 * self.var_cap, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self.hvar = [h[off:].numpy().view(np.int64) for h in self.hbufs]
        self.dvar = self.dbuf[off:].view(torch.int64)
        self.events = [None, None]
        self.dev = self._views(self.dbuf)  # the step's fields on the device (the graphs read these)
        self.host = [self._views(h.numpy()) for h in self.hbufs]
        for h in self.host:  # padding rows: write nowhere, attend to one key, sample neutrally
            h["lens"][:] = 1
            h["kv_slots"][:] = -1
            h["lora"][:] = -1
            h["table"][:] = self.num_tables
            h["temp"][:] = 1.0
            h["top_p"][:] = 1.0
        self.dbuf.copy_(self.hbufs[0])
        self._turn = 0  # the staging copy the next step fills
        self.prev: ScheduledBatch | None = None  # the last step, when the next one may continue it
        self._prev_tables: list[int] = []  # its rows' tables
        self._prev_max_k = 0  # its longest context
        self.num_continued = 0  # steps that continued the one before on the device

    # ------------------------------------------------------------------ the three operations
    def load(self, batch: ScheduledBatch, pad_to: int, last_samples: torch.Tensor | None) -> int:
        """Put decode step `batch`'s fields on the device (rows len(batch) .. pad_to as padding
        rows when staged) -> the step's longest context (max_seqlen_k). last_samples: the
        previous launch's sampled tokens on the device (placeholders' values), or None."""
        k = self._turn
        self._turn ^= 1
        if last_samples is not None and batch.continues(self.prev):
            max_k = self._prev_max_k + 1
            self._continue(batch.seqs, k, last_samples)
        else:
            max_k = max(s.num_computed_tokens for s in batch.seqs) + 1
            self._stage(batch.seqs, k, pad_to, last_samples)
        self.prev, self._prev_max_k = batch, max_k
        return max_k

    def invalidate(self) -> None:
        """The next step is no continuation of the last one (a step of another kind ran)."""
        self.prev = None

    def reset(self) -> None:
        """Forget which sequence holds which table (every sequence was preempted)."""
        self.prev = None
        self.table_of.clear()
        self.free = list(range(self.num_tables - 1, -1, -1))
        self.sent_list = [None] * self.num_tables
        self.sent_n = [0] * self.num_tables

    # ------------------------------------------------------------------ what the step reads
    def block_tables(self, n: int, width: int) -> torch.Tensor:
        """The first n rows' block tables, `width` entries each: [n, width] int32 (a gather)."""
        return self.tables[self.dev["table"][:n], :width]

    def sampling(self, n: int) -> tuple:
        """The sampler's per-row tensors of the first n rows."""
        v = self.dev
        return v["temp"][:n], v["top_k"][:n], v["top_p"][:n], v["min_p"][:n], v["seeds"][:n], v["offsets"][:n]

    # ------------------------------------------------------------------ stage / continue
    def _continue(self, seqs: list, k: int, last_samples: torch.Tensor) -> None:
        """The step after `self.prev`, the same sequences in the same rows: the device advances
        its fields; the host sends only the table entries that changed."""
        upd_i, upd_v = [], []
        sent_list, sent_n, sent_last = self.sent_list, self.sent_n, self.sent_last
        for s, t in zip(seqs, self._prev_tables):
            bt = s.block_table
            if sent_list[t] is not bt or sent_n[t] != len(bt) or sent_last[t] != bt[-1]:
                self._sync_table(t, bt, upd_i, upd_v)
        K = len(upd_i)
        if K:
            self._staging(k)
            var = self._send(k, upd_i + upd_v, fixed=False)
            self.tables.view(-1).index_copy_(0, var[:K], var[K:].to(torch.int32))
        S, bs, v = len(seqs), self.block_size, self.dev
        v["ids"][:S].copy_(last_samples[:S])
        for f in ("pos", "lens", "offsets"):
            v[f][:S] += 1
        pos = v["pos"][:S]  # the kv slot of each row's token: its block's entry in the row's table
        blk = self.tables.view(-1)[v["table"][:S] * self.width + torch.div(pos, bs, rounding_mode="floor")]
        torch.add(pos % bs, blk.to(torch.int64), alpha=bs, out=v["kv_slots"][:S])
        self.num_continued += 1

    def _stage(self, seqs: list, k: int, pad_to: int, last_samples: torch.Tensor | None) -> None:
        """A step's fields from the host: one pass over the rows into staging copy k, one copy
        to the device (fixed fields, then table updates and placeholder rows)."""
        bs, S = self.block_size, len(seqs)
        h = self._staging(k)
        table_of, sent_list, sent_n, sent_last = self.table_of, self.sent_list, self.sent_n, self.sent_last
        ids, kvs, offs, ts, sd = [], [], [], [], []
        upd_i, upd_v, ph, ph_rows, fl = [], [], [], [], []
        for i, s in enumerate(seqs):
            t = table_of.get(s.seq_id)
            if t is None:
                t = self._assign(s, seqs)
            bt = s.block_table
            if sent_list[t] is not bt or sent_n[t] != len(bt) or sent_last[t] != bt[-1]:
                self._sync_table(t, bt, upd_i, upd_v)
            c = s.num_computed_tokens
            tok = s.token_ids[c]
            if tok < 0:  # a placeholder: the token sampled by the last step, still on the device
                ph.append(i)
                ph_rows.append(s.pending_row)
            ids.append(tok)
            kvs.append(bt[c // bs] * bs + c % bs)
            offs.append(len(s.token_ids) - s.num_prompt_tokens)
            ts.append(t)
            sp = s.params
            fl.append((sp.temperature, sp.top_p, sp.min_p))
            sd.append((sp.top_k, s.own_seed))
        self._prev_tables = ts
        h["ids"][:S] = ids
        h["ids"][S:pad_to] = 0
        h["kv_slots"][:S] = kvs
        h["kv_slots"][S:pad_to] = -1
        pos = h["pos"]
        pos[:S] = [s.num_computed_tokens for s in seqs]
        pos[S:pad_to] = 0
        h["lens"][:S] = pos[:S] + 1
        h["lens"][S:pad_to] = 1
        h["table"][:S] = ts
        h["table"][S:pad_to] = self.num_tables
        h["lora"][:S] = [s.lora for s in seqs]
        h["lora"][S:pad_to] = -1
        f = np.array(fl, dtype=np.float32)
        h["temp"][:S], h["top_p"][:S], h["min_p"][:S] = f[:, 0], f[:, 1], f[:, 2]
        si = np.array(sd, dtype=np.int64)
        h["top_k"][:S], h["seeds"][:S] = si[:, 0], si[:, 1]
        h["offsets"][:S] = offs
        # the device half: one copy (fixed fields, then table updates and placeholder rows)
        K, P = len(upd_i), len(ph)
        var = self._send(k, upd_i + ph + ph_rows + upd_v)
        if K:
            self.tables.view(-1).index_copy_(0, var[:K], var[K + 2 * P:].to(torch.int32))
        if P:
            self.dev["ids"].index_copy_(0, var[K:K + P], last_samples.index_select(0, var[K + P:K + 2 * P]))

    # ------------------------------------------------------------------ tables, copies
    def _assign(self, seq, live) -> int:
        """A table for `seq` (tables of sequences not in this step are reclaimed when none is free)."""
        if not self.free:
            keep = {s.seq_id for s in live}
            for sid, t in list(self.table_of.items()):
                if sid not in keep:
                    del self.table_of[sid]
                    self.sent_list[t] = None
                    self.free.append(t)
        t = self.free.pop()
        self.table_of[seq.seq_id] = t
        self.sent_list[t] = None
        return t

    def _sync_table(self, t: int, bt: list[int], upd_i: list[int], upd_v: list[int]) -> None:
        """Queue the entries of table t that differ from block table `bt`: the blocks appended
        since they were last sent, and the last one sent when copy-on-write replaced it."""
        if self.sent_list[t] is bt:
            n = self.sent_n[t]
            if n > len(bt):
                n = 0
            elif n and bt[n - 1] != self.sent_last[t]:
                n -= 1
        else:
            self.sent_list[t], n = bt, 0
        L = len(bt)
        if L > n:
            base = t * self.width
            upd_i.extend(range(base + n, base + L))
            upd_v.extend(bt[n:])
            self.sent_n[t], self.sent_last[t] = L, bt[-1]

    def _staging(self, k: int) -> dict:
        """Staging copy k's host views, once its last copy to the device has been read."""
        if self.events[k] is not None:
            self.events[k].synchronize()
        return self.host[k]

    def _send(self, k: int, var: list[int], fixed: bool = True) -> torch.Tensor:
        """Copy staging copy k's fixed fields (unless `fixed` is False) and `var` (int64) to
        the device in one non-blocking copy (two when `var` exceeds the pinned room) -> var
        on the device. Call `_staging(k)` before filling the buffer."""
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
