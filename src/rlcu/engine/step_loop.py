"""The steps of one `generate` call: schedule, launch, read back, with a one-step lookahead
and the yield protocol (LLM's module docstring says what the caller sees); `GenerateStats`,
what `LLM.stats` reports of the call.

Lookahead: step t+1 is scheduled and launched before step t's samples are read back (the
scheduler's `advance` / `resolve` halves), so the host's work overlaps the device's. Yield:
between two steps, once a new token was sampled since the last yield, `yield_check()` is
asked; when true the step in flight is read back (every sampled token is then known) and
`do_yield()` gives the device away and takes it back (LLM._yield: preempt all, sleep,
on_yield, wake).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import NamedTuple

from rlcu.engine.scheduler import ScheduledBatch, Scheduler
from rlcu.engine.sequence import Sequence


@dataclasses.dataclass
class GenerateStats:
    """Counters and host times (seconds) of one generate call."""

    steps: int = 0
    graph_steps: int = 0  # steps that replayed a CUDA graph
    prefill_tokens: int = 0  # tokens computed by prefill and mixed steps
    decode_tokens: int = 0  # tokens computed by pure decode steps
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens served by the prefix cache
    yields: int = 0
    t_schedule: float = 0.0
    t_launch: float = 0.0
    t_wait: float = 0.0  # waiting for the device's samples
    t_postprocess: float = 0.0
    t_yield: float = 0.0
    # per step: (tokens, sequences, context tokens after it, graph replayed, seconds since the last launch)
    step_log: list = dataclasses.field(default_factory=list)
    wall: float = 0.0
    output_tokens: int = 0

    def count_step(self, batch: ScheduledBatch, graph: bool, dt: float) -> None:
        """Account for a launched step (after the scheduler's `advance`)."""
        ntok = sum(batch.num_tokens)
        self.steps += 1
        self.graph_steps += graph
        if batch.is_decode:
            self.decode_tokens += ntok
        else:
            self.prefill_tokens += ntok
        ctx = sum(s.num_computed_tokens for s in batch.seqs)
        self.step_log.append((ntok, len(batch), ctx, bool(graph), dt))

    def as_dict(self) -> dict:
        """The `LLM.stats` dict (keys: the fields, in order)."""
        return dict(vars(self))


class _Launched(NamedTuple):
    batch: ScheduledBatch
    rows: list[Sequence]  # the sequences owning the step's sample rows (Scheduler.advance)
    out: object  # the runner's launch output, for `collect`


class StepLoop:
    """Runs the scheduler's sequences to the end on `runner` (an object with `launch(batch)
    -> (out, graph)` and `collect(out) -> (tokens, logprobs)`, as ModelRunner). need: request
    index -> the samples it waits for; done: request index -> its finished sequences."""

    def __init__(self, scheduler: Scheduler, runner, need: dict[int, int], *, lookahead: bool,
                 yield_check: Callable[[], bool] | None = None, do_yield: Callable[[], None] | None = None):
        self.sch, self.runner, self.need, self.lookahead = scheduler, runner, need, lookahead
        self.yield_check, self.do_yield = yield_check, do_yield
        self.stats = GenerateStats()
        self.done: dict[int, list[Sequence]] = {}
        self.n_done = self.n_tok = 0  # requests complete, tokens read back
        self._prev: _Launched | None = None  # the launched step whose samples are not read back yet
        self._tok_at_yield = -1  # n_tok at the last yield: the next waits for a new token (no livelock)
        self._t_last = 0.0  # the last launch's (or yield's) end

    def run(self, progress: Callable[[int, int], None] | None = None) -> dict[int, list[Sequence]]:
        """Every step until nothing is left -> done. progress(requests done, tokens) after each
        step. On any exception every sequence is aborted (their blocks freed) and it propagates."""
        sch, st = self.sch, self.stats
        pre0, hit0 = sch.num_preemptions, sch.bm.hit_tokens
        t_start = self._t_last = time.perf_counter()
        try:
            while True:
                self._between()
                if not sch.has_unfinished() and self._prev is None:
                    if self._idle():
                        continue
                    break
                if not self._yielded():
                    self._step()
                if progress is not None:
                    progress(self.n_done, self.n_tok)
        except BaseException:
            sch.abort_all()
            raise
        st.wall = time.perf_counter() - t_start
        st.preemptions = sch.num_preemptions - pre0
        st.cached_tokens = sch.bm.hit_tokens - hit0
        st.output_tokens = sum(len(s.token_ids) - s.num_prompt_tokens for ss in self.done.values() for s in ss)
        return self.done

    def _between(self) -> None:
        """Before each step: a subclass's work between steps (episodes resume here)."""

    def _idle(self) -> bool:
        """Nothing can be scheduled and no step is in flight: wait for what could make more
        (episodes: their callbacks) -> whether there may be more steps."""
        return False

    def _finished(self, s: Sequence) -> None:
        """A sequence finished (its tokens all read back)."""
        got = self.done.setdefault(s.request_id, [])
        got.append(s)
        if len(got) == self.need[s.request_id]:
            self.n_done += 1

    def _yielded(self) -> bool:
        """Between two steps: when yield_check() says so, finish the step in flight and yield."""
        sch = self.sch
        if (self.yield_check is None or self.n_tok <= self._tok_at_yield or not sch.has_unfinished()
                or not self.yield_check()):
            return False
        if self._prev is not None:  # finish the step in flight: every sampled token is then known
            self._read_back(self._prev)
            self._prev = None
        if sch.has_unfinished():
            t_y = time.perf_counter()
            self.do_yield()
            self.stats.yields += 1
            self._t_last = time.perf_counter()
            self.stats.t_yield += self._t_last - t_y
        self._tok_at_yield = self.n_tok
        return True

    def _step(self) -> None:
        """Schedule and launch the next step, then read back the one before (lookahead) or
        this one."""
        sch, st = self.sch, self.stats
        t0 = time.perf_counter()
        batch = sch.schedule()
        t1 = time.perf_counter()
        launched = None
        if batch.seqs:
            out, graph = self.runner.launch(batch)
            t2 = time.perf_counter()
            launched = _Launched(batch, sch.advance(batch), out)
            st.count_step(batch, graph, t2 - self._t_last)
            self._t_last = t2
            st.t_launch += t2 - t1
        elif self._prev is None:
            raise RuntimeError("the scheduler made no progress (a bug: please report it)")
        st.t_schedule += t1 - t0
        if self._prev is not None:
            self._read_back(self._prev)
        if self.lookahead:
            self._prev = launched
        elif launched is not None:
            self._read_back(launched)

    def _read_back(self, step: _Launched) -> None:
        """Wait for a launched step's samples and account for them."""
        t3 = time.perf_counter()
        toks, lps = self.runner.collect(step.out)
        t4 = time.perf_counter()
        for s in self.sch.resolve(step.batch, step.rows, toks, lps):
            self._finished(s)
        self.stats.t_wait += t4 - t3
        self.stats.t_postprocess += time.perf_counter() - t4
        self.n_tok += len(toks)
