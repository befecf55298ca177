"""Which sequences run in the next step, and how many tokens each computes (policy only).

One step computes a chunk of tokens for each scheduled sequence under a token budget
(`max_num_batched_tokens`); decode (a 1-token chunk) and chunked prefill mix freely:
1. running sequences, oldest first, each take min(its uncomputed tokens, the budget left);
   when the KV pool cannot hold a sequence's chunk, the newest running sequences are
   preempted (their blocks freed; they go back to the front of the waiting queue and are
   recomputed later, reusing whatever of their prefix is still cached);
2. then, if nothing was preempted, waiting sequences in arrival order, while the budget,
   `max_num_seqs` and the free blocks allow (each starts from its longest cached prefix).

Why it never deadlocks: the oldest running sequence can always take blocks from the newer
ones, and a single sequence of `max_model_len` tokens fits in the pool (max_model_len is
capped at the pool's size), so the oldest sequence advances every step until it finishes.
No request is dropped: a preempted sequence keeps its tokens and its place at the head of
the queue. `preempt_all` does the same to every running sequence at once, so that the engine
can release its KV pool between two steps (LLM.generate's yield) and recompute afterwards.

A step's bookkeeping comes in two halves so that the engine can launch step t+1 before it
reads back step t's tokens (one-step lookahead): `advance` right after the launch (computed
counts, forks, a placeholder per sampled token, length limits: all known without the
values) and `resolve` once the values are back (fill the placeholders, stop tokens, prefix
cache registration, retiring finished sequences). A sequence that samples a stop token at
step t has already been scheduled for step t+1; that row is wasted and dropped.

Episodes (engine/episodes.py): a sequence that `parks` is PARKED at the end of a turn with
its blocks kept (`parked`) instead of freed; `resume` appends the environment's tokens and
queues it in `ready`, admitted before the waiting queue, so that only the new tokens are
computed. Parked and ready sequences are idle holders of blocks: when a running or ready
sequence needs blocks they are evicted first (parked, newest first, then ready ones), as
preemption for recompute does (their tokens kept; a parked one is recomputed when it
resumes), and when nothing else runs, a waiting sequence may evict parked ones too, so the
engine never stalls on a callback while something could run. `end` frees an episode.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections import deque

from rlcu.engine.block_manager import BlockManager
from rlcu.engine.sequence import Sequence, Status


@dataclasses.dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # the chunk each sequence computes
    num_samples: list[int]  # tokens sampled from its last row: 0 (chunk not final), 1, or n (unforked leader)
    copies: list[tuple[int, int]]  # (src, dst) KV blocks to copy before the step (copy-on-write)

    @functools.cached_property
    def is_decode(self) -> bool:
        return all(t == 1 for t in self.num_tokens) and all(s == 1 for s in self.num_samples)

    def continues(self, prev: ScheduledBatch | None) -> bool:
        """Whether this step continues `prev`, the step launched just before it: both are pure
        decode steps over the same sequence objects in the same order. Each sequence then sits
        in the same row, and a decode step computes one token of each sequence and samples the
        next, so row i's token is prev's sample of row i and its position, context length and
        sample offset are prev's plus one (its sampling parameters are the same). A sequence
        preempted and admitted again in between resumes where it stopped (a one-token chunk
        after a prefix-cache hit is again the next token), so the rule holds for it too. The
        caller passes prev=None after any step that is not a pure decode step."""
        return (prev is not None and self.is_decode and prev.is_decode and len(prev.seqs) == len(self.seqs)
                and all(map(operator.is_, self.seqs, prev.seqs)))

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.unresolved: dict[int, Sequence] = {}  # finished by length, their last token not yet read back
        self.parked: dict[int, Sequence] = {}  # episodes between turns, oldest first (blocks kept)
        self.ready: deque[Sequence] = deque()  # resumed episodes that hold blocks, not yet admitted
        self.num_preemptions = 0
        self.on_retire = None  # called with a finished sequence before its blocks are freed (the route log)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Whether a sequence can be scheduled (parked ones wait for their environment)."""
        return bool(self.waiting or self.running or self.ready)

    def live(self) -> list[Sequence]:
        """Every sequence that holds or may hold blocks."""
        return (self.running + list(self.ready) + list(self.waiting) + list(self.unresolved.values())
                + list(self.parked.values()))

    def _requeue(self, seq: Sequence) -> None:
        """Preemption for recompute: free seq's blocks, keep its tokens, and put it at the head
        of the waiting queue (it is recomputed from its tokens when admitted again)."""
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        self.num_preemptions += 1

    def _evict_idle(self, keep: Sequence | None = None) -> bool:
        """Free the blocks of one idle sequence: the newest parked one that holds any, else the
        newest ready one (but `keep`), which goes back to the waiting queue. False if none."""
        for seq in reversed(self.parked.values()):
            if seq.block_table:
                self.bm.free(seq)
                seq.num_computed_tokens = 0
                self.num_preemptions += 1
                return True
        if self.ready and self.ready[-1] is not keep:
            self._preempt(self.ready.pop())
            return True
        return False

    # ------------------------------------------------------------------ episodes
    def resume(self, seq: Sequence, ids: list[int], max_len: int) -> None:
        """Continue a parked episode: append the environment's tokens `ids` (logprob 0.0), the
        next turn ending with "length" at `max_len` tokens. It keeps its blocks and its
        computed tokens (only the new ones are computed), or, evicted meanwhile, is recomputed
        through the waiting queue (at its head: episodes under way go first)."""
        if seq.status is not Status.PARKED or seq.num_stale:
            raise RuntimeError(f"resume of {seq}: only a parked sequence with no step in flight resumes")
        del self.parked[seq.seq_id]
        seq.token_ids += ids
        seq.logprobs += [0.0] * len(ids)
        seq.max_len, seq.finish_reason, seq.status = max_len, None, Status.WAITING
        if seq.block_table:
            self.ready.append(seq)
        else:
            self.waiting.appendleft(seq)

    def end(self, seq: Sequence) -> None:
        """An episode is over: free its blocks."""
        if self.parked.pop(seq.seq_id, None) is None:
            raise RuntimeError(f"end of {seq}: only a parked sequence ends")
        self.bm.free(seq)
        seq.status = Status.FINISHED

    def preempt_all(self) -> list[Sequence]:
        """Preempt every running sequence for recompute, as memory pressure does, so that no
        sequence holds a block (the engine can then release the KV pool). The waiting queue
        becomes the running sequences, oldest first, then the ready ones, then those that were
        waiting; parked episodes free their blocks too (recomputed when they resume). Every
        sampled token must be known: call it with no step in flight. Returns the live
        sequences, in queue order. (Not counted in `num_preemptions`.)"""
        if self.unresolved or any(s.num_pending for s in self.running):
            raise RuntimeError("preempt_all with a step in flight: read its tokens back first")
        for seq in reversed(self.running + list(self.ready)):
            self._requeue(seq)
        self.running, self.ready = [], deque()
        for seq in self.parked.values():
            self.bm.free(seq)
            seq.num_computed_tokens = 0
        return list(self.waiting)

    def schedule(self) -> ScheduledBatch:
        bm, budget = self.bm, self.max_num_batched_tokens
        blocks_needed = bm.blocks_needed
        seqs, ntok, copies = [], [], []
        queue, kept = deque(self.running), []
        preempted = False
        while queue:  # (the hot loop of a decode step: one pass, no call unless a block is needed)
            seq = queue.popleft()
            if budget == 0:
                kept.append(seq)
                continue
            c = seq.num_computed_tokens
            take = len(seq.token_ids) - c
            if take > budget:
                take = budget
            end = c + take
            need = blocks_needed(seq, end)
            if need:
                while need > bm.num_free and (queue or self.parked or self.ready):
                    if not self._evict_idle():  # idle holders first, then the newest running
                        if not queue:
                            break
                        self._preempt(queue.pop())
                    preempted = True
                    need = blocks_needed(seq, end)  # the victim may have shared a block with seq
                if need > bm.num_free:
                    self._preempt(seq)
                    preempted = True
                    continue
                if need:
                    copies += bm.reserve(seq, end)
            seqs.append(seq)
            ntok.append(take)
            kept.append(seq)
            budget -= take

        if not preempted or not seqs:
            rows = sum(s.num_samples for s in kept)
            while (self.ready or self.waiting) and budget > 0:
                queue = self.ready or self.waiting
                seq = queue[0]
                if seq.num_pending or (kept and rows + seq.num_samples > self.max_num_seqs):
                    break  # (a preempted sequence waits for its last token's value)
                start = seq.num_computed_tokens
                if queue is self.ready:  # blocks kept: compute the new tokens
                    take = min(len(seq) - start, budget)
                    while blocks_needed(seq, start + take) > bm.num_free and self._evict_idle(keep=seq):
                        pass
                    if blocks_needed(seq, start + take) > bm.num_free:
                        break
                else:
                    hits = bm.match_prefix(seq)
                    start = len(hits) * bm.block_size
                    take = min(len(seq) - start, budget)
                    while (bm.admission_cost(hits, start + take) > bm.num_free and not kept and self.parked
                           and self._evict_idle()):  # nothing else runs: do not wait on callbacks
                        pass
                    if bm.admission_cost(hits, start + take) > bm.num_free:
                        break
                    bm.use_prefix(seq, hits)
                queue.popleft()
                copies += bm.reserve(seq, start + take)
                seq.status = Status.RUNNING
                seqs.append(seq)
                ntok.append(take)
                kept.append(seq)
                rows += seq.num_samples
                budget -= take

        self.running = kept
        nsamp = [s.num_samples if s.num_computed_tokens + t == len(s.token_ids) else 0 for s, t in zip(seqs, ntok)]
        return ScheduledBatch(seqs, ntok, nsamp, copies)

    def advance(self, batch: ScheduledBatch) -> list[Sequence]:
        """Account for a launched step, before its tokens are known: advance the computed
        counts, fork the leaders that finished their prompt, append a placeholder for each
        sampled token, and stop scheduling the sequences that reached their length limit.
        Returns the sequences owning the step's sample rows, in row order."""
        rows, forks, finished = [], {}, False
        max_len = self.max_model_len
        for seq, take, ns in zip(batch.seqs, batch.num_tokens, batch.num_samples):
            seq.num_computed_tokens += take
            if ns == 0:
                continue
            group = (seq,)
            if ns > 1:
                seq.num_samples = 1
                children = [seq.fork(j) for j in range(1, ns)]
                for child in children:
                    self.bm.fork(seq, child)
                    child.status = Status.RUNNING
                forks[seq.seq_id] = children
                group += tuple(children)
            for s in group:
                s.pending_row = len(rows)
                rows.append(s)
                s.token_ids.append(-1)
                s.logprobs.append(0.0)
                s.num_pending += 1
                n = len(s.token_ids)
                if n >= s.max_len or n >= max_len:
                    s.status, s.finish_reason = Status.FINISHED, "length"  # blocks kept until resolved
                    finished = True
        if forks or finished:
            order = []
            for s in self.running:
                order.append(s)
                order += forks.get(s.seq_id, ())
            self.running = [s for s in order if s.status is Status.RUNNING]
        if finished:
            self.unresolved.update((s.seq_id, s) for s in rows if s.status is Status.FINISHED)
        return rows

    def resolve(self, batch: ScheduledBatch, rows: list[Sequence], tokens: list[int],
                logprobs: list[float]) -> list[Sequence]:
        """Fill in the step's sampled tokens; retire the sequences that sampled a stop token
        (dropping a later placeholder, if the next step was already launched) or whose last
        token this was. Returns the sequences finished now."""
        finished = []
        for s, tok, lp in zip(rows, tokens, logprobs):
            if s.num_stale:  # it stopped at an earlier step; this row was computed in vain
                s.num_stale -= 1
                continue
            i = len(s.token_ids) - s.num_pending  # the oldest placeholder
            j = i - s.num_prompt_tokens
            s.token_ids[i], s.logprobs[j] = tok, lp
            s.num_pending -= 1
            if tok in s.stop_ids:
                del s.token_ids[i + 1:], s.logprobs[j + 1:]
                s.num_stale, s.num_pending = s.num_pending, 0  # (the later placeholders: rows in flight)
                if s.status is Status.WAITING:
                    self.waiting.remove(s)
                s.status, s.finish_reason = Status.FINISHED, "stop"
            if s.status is Status.FINISHED and s.num_pending == 0:
                s.num_computed_tokens = min(s.num_computed_tokens, len(s.token_ids))
                self.bm.commit(s)
                if s.parks:  # an episode's turn: keep the blocks for its next one
                    s.status = Status.PARKED
                    self.parked[s.seq_id] = s
                else:
                    if self.on_retire is not None:
                        self.on_retire(s)
                    self.bm.free(s)
                self.unresolved.pop(s.seq_id, None)
                finished.append(s)
        bs, commit = self.bm.block_size, self.bm.commit
        for group in (batch.seqs, rows):  # computed tokens are all known now: register full blocks
            for s in group:  # (commit's own test, inline: most steps fill no block)
                if s.num_computed_tokens // bs != s.num_hashed_blocks and s.status is not Status.FINISHED:
                    commit(s)
        if finished:
            self.running = [s for s in self.running if s.status is Status.RUNNING]
        return finished

    def postprocess(self, batch: ScheduledBatch, tokens: list[int], logprobs: list[float]) -> list[Sequence]:
        """advance + resolve: a step whose tokens are already known (no lookahead)."""
        return self.resolve(batch, self.advance(batch), tokens, logprobs)

    def abort_all(self) -> list[Sequence]:
        """Drop every sequence (after an error), freeing their blocks."""
        seqs = self.live()
        for s in seqs:
            self.bm.free(s)
            s.status = Status.FINISHED
        self.running, self.waiting, self.unresolved, self.ready, self.parked = [], deque(), {}, deque(), {}
        return seqs
