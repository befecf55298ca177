"""Episodes: generation that goes on after an environment answers (`LLM.run_episodes`), token in
and token out.

    def on_turn(i, turn_ids, finish_reason):      # in a thread pool, when episode i's turn ends
        return env_ids or None                      # tokens to append and go on, or None: the end
    eps = llm.run_episodes(starts, SamplingParams(n=G, max_tokens=256, seed=1), on_turn, max_turns=4)
    eps[k].ids / .model_mask / .logprobs / .turns / .finish_reason / .env_time_s / .error

An episode is one engine sequence from its start to its end: a turn ends as a plain generation
does (a stop token, EOS, or max_tokens, which is per turn), the sequence is *parked* with its KV
blocks kept while `on_turn` runs, and the environment's tokens are appended to it as they are
(never re-tokenised); when it resumes, only the new tokens are computed, as a prefill chunk
through the same paths (and graphs) as any other. The step loop never waits on a callback
while another sequence can run; it blocks on one only when nothing else can. Parked sequences'
blocks count in the pool: under pressure they are evicted first and recomputed when they resume
(Scheduler's docstring); exact mode makes a recompute give the same bits.

Episode k of the returned list is sample j of start i, k = (the samples of the starts before i)
+ j: `SamplingParams.n` > 1 runs n episodes of one start, which share its prefilled blocks
(the prefix is computed once and forked, as generate's n samples); identical starts given
separately share only what the prefix cache holds when they are admitted.

Sampling: episode j of a start seeded s draws from `sample_seed(s, j)` at offset = the tokens
after its start (the environment's included), so its turns never redraw the same numbers and
a run repeats given the seed and the environment's tokens.

Limits: `max_turns` (the model's turns; an `on_turn` that returns tokens after the last one
ends the episode with "max_turns", the tokens not appended) and `max_episode_tokens` (the
tokens after the start, model's and environment's; the context's max_model_len also bounds
it): a turn is cut there, and tokens that leave no room for one more sampled token end the
episode with "length", not appended. Either may be a list of one per start (a LoRA host runs
several jobs' episodes, each with its own limits, in one call). `on_turn` is called at the end
of every turn, so that the environment sees each; an exception in it (or tokens that are not a non-empty list of ids in
the vocabulary) ends that episode with "error" and the exception on `Episode.error`.
"""

from __future__ import annotations

import dataclasses
import queue
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from rlcu.engine import requests
from rlcu.engine.params import SamplingParams
from rlcu.engine.progress import Progress
from rlcu.engine.scheduler import Scheduler
from rlcu.engine.sequence import Sequence
from rlcu.engine.step_loop import StepLoop

ENV_LOGPROB = 0.0  # the logprob an environment token carries in Episode.logprobs (masked out by model_mask)


@dataclasses.dataclass
class Episode:
    """One episode. ids: every token after `start_ids`, the model's and the environment's in
    order; model_mask[t] = 1 where ids[t] was sampled by the model, 0 for the environment's;
    logprobs[t]: the sampled token's logprob (as generate's, under the temperature-scaled,
    unfiltered distribution), ENV_LOGPROB (0.0) for an environment token. turns: the model's
    turns. finish_reason: "stop" or "length" (how the last turn ended, when on_turn returned
    None), "max_turns", "length" (the episode's token limit), or "error" (`error` holds the
    exception). env_time_s: seconds spent in on_turn."""

    index: int
    start_index: int  # which start
    sample_index: int  # which of its n samples
    start_ids: list[int]
    ids: list[int] = dataclasses.field(default_factory=list)
    model_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    turns: int = 0
    finish_reason: str | None = None
    env_time_s: float = 0.0
    error: BaseException | None = None

    @property
    def num_model_tokens(self) -> int:
        return sum(self.model_mask)


@dataclasses.dataclass
class EpisodeStats:
    """What run_episodes adds to `LLM.stats` (under "episodes")."""

    episodes: int = 0
    turns: int = 0
    env_tokens: int = 0  # tokens appended by on_turn
    resume_tokens: int = 0  # tokens left to compute at resumes that kept their blocks (what they prefill)
    env_time_s: float = 0.0  # in on_turn, summed over threads
    env_wait_s: float = 0.0  # the step loop blocked because nothing but callbacks could make progress
    errors: int = 0


def _check(name: str, v, lo: int, allow_none: bool) -> None:
    if (v is None and allow_none) or (isinstance(v, int) and not isinstance(v, bool) and v >= lo):
        return
    raise ValueError(f"run_episodes({name}=...) must be an integer >= {lo}{' or None' if allow_none else ''}, "
                     f"got {v!r}")


def _per_start(name: str, v, n: int) -> list:
    """A limit as one per start: one value for all, or a list of n (each checked as _check's)."""
    vs = list(v) if isinstance(v, (list, tuple)) else [v] * n
    if len(vs) != n:
        raise ValueError(f"run_episodes({name}=...) got {len(vs)} values for {n} starts: give one, or one per start")
    for x in vs:
        _check(name, x, 1, True)
    return vs


class EpisodeLoop(StepLoop):
    """The step loop of run_episodes: a turn's end (`_finished`) hands the turn to on_turn in the
    pool; between steps the callbacks' answers resume or end their episodes."""

    def __init__(self, sch: Scheduler, runner, episodes: list[Episode], base: dict[int, int], on_turn: Callable,
                 pool: ThreadPoolExecutor, *, lookahead: bool, max_turns: list[int | None], limit: list[int],
                 vocab_size: int, yield_check=None, do_yield=None):
        super().__init__(sch, runner, {}, lookahead=lookahead, yield_check=yield_check, do_yield=do_yield)
        self.episodes, self.base, self.on_turn, self.pool = episodes, base, on_turn, pool
        self.max_turns, self.limit, self.vocab_size = max_turns, limit, vocab_size
        self.ep_stats = EpisodeStats(episodes=len(episodes))
        self.seqs: dict[int, Sequence] = {}  # episode index -> its sequence (forks known at their first turn)
        self.answers: queue.SimpleQueue = queue.SimpleQueue()  # (episode, on_turn's tokens, exception, seconds)
        self.pending = 0  # callbacks submitted whose answers are not applied yet
        self.deferred: list[tuple] = []  # answers for sequences with a step in flight

    def tokens_left(self, s: Sequence) -> int:
        """The model tokens s's episodes may still sample (a yield's work, which a scheduled job
        asks again with): the rest of the turn in progress (none while parked) and max_tokens
        per turn that max_turns leaves, within the episode's room (its token limit)."""
        ep = self.episodes[self.base[s.request_id] + s.sample_index]
        parked = self.sch.parked.get(s.seq_id) is s
        room = max(self.limit[s.request_id] - len(s), 0)
        turn = 0 if parked else max(s.max_len - len(s), 0)
        turns = self.max_turns[s.request_id]
        more = room if turns is None else max(turns - ep.turns - (0 if parked else 1), 0) * s.params.max_tokens
        return s.num_samples * min(room, turn + more)

    # ------------------------------------------------------------------ the turn's end
    def _finished(self, s: Sequence) -> None:
        ep = self.episodes[self.base[s.request_id] + s.sample_index]
        self.seqs[ep.index] = s
        turn = s.token_ids[s.num_prompt_tokens + len(ep.model_mask):]
        ep.model_mask += [1] * len(turn)
        ep.turns += 1
        self.ep_stats.turns += 1
        self.pending += 1
        self.pool.submit(self._call, ep.index, turn, s.finish_reason)

    def _call(self, i: int, turn: list[int], reason: str) -> None:
        """In the pool: on_turn, its answer or exception queued for the step loop."""
        t0, out, err = time.perf_counter(), None, None
        try:
            out = self.on_turn(i, turn, reason)
        except BaseException as e:  # noqa: BLE001 - kept on the episode, never a crash
            err = e
        finally:
            self.answers.put((i, out, err, time.perf_counter() - t0))

    # ------------------------------------------------------------------ answers
    def _between(self) -> None:
        todo, self.deferred = self.deferred, []
        while True:
            try:
                todo.append(self.answers.get_nowait())
            except queue.Empty:
                break
        for a in todo:
            self._apply(*a)

    def _idle(self) -> bool:
        if not self.pending:
            return False
        t0 = time.perf_counter()
        a = self.answers.get() if not self.deferred else None
        self.ep_stats.env_wait_s += time.perf_counter() - t0
        if a is not None:
            self.deferred.append(a)
        return True

    def _apply(self, i: int, out, err: BaseException | None, dt: float) -> None:
        ep, s = self.episodes[i], self.seqs[i]
        if s.num_stale:  # a step launched before its turn ended is still in flight: after its read-back
            self.deferred.append((i, out, err, dt))
            return
        self.pending -= 1
        ep.env_time_s += dt
        self.ep_stats.env_time_s += dt
        if err is None and out is not None:
            ids = requests.token_ids(out)
            if not ids:
                err = ValueError(f"on_turn({i}) returned {type(out).__name__} {out!r:.80}: a non-empty list of "
                                 "token ids continues the episode, None ends it")
            elif min(ids) < 0 or max(ids) >= self.vocab_size:
                bad = next(t for t in ids if not 0 <= t < self.vocab_size)
                err = ValueError(f"on_turn({i}) returned token id {bad}, outside the vocabulary [0, "
                                 f"{self.vocab_size})")
        if err is not None:
            ep.error = err
            self.ep_stats.errors += 1
            return self._end(ep, s, "error")
        if out is None:
            return self._end(ep, s, s.finish_reason)
        turns = self.max_turns[ep.start_index]
        if turns is not None and ep.turns >= turns:
            return self._end(ep, s, "max_turns")
        limit = self.limit[ep.start_index]
        if len(s) + len(ids) >= limit:
            return self._end(ep, s, "length")
        ep.model_mask += [0] * len(ids)
        self.ep_stats.env_tokens += len(ids)
        self.sch.resume(s, ids, min(len(s) + len(ids) + s.params.max_tokens, limit))
        if s.block_table:
            self.ep_stats.resume_tokens += len(s) - s.num_computed_tokens

    def _end(self, ep: Episode, s: Sequence, reason: str) -> None:
        self.sch.end(s)
        ep.ids = s.token_ids[s.num_prompt_tokens:]
        ep.logprobs = list(s.logprobs)
        ep.finish_reason = reason
        self.n_done += 1


def run_episodes(llm, starts, sampling_params: SamplingParams | list[SamplingParams], on_turn: Callable, *,
                 max_workers: int = 32, use_tqdm: bool = False, max_turns: int | None = None,
                 max_episode_tokens: int | None = None, lora=None, yield_check=None, on_yield=None,
                 on_done=None) -> list[Episode]:
    """LLM.run_episodes (see the module docstring); max_turns, max_episode_tokens: one for all
    or a list of one per start. starts: token-id lists or
    {"prompt_token_ids": [...]} dicts. lora: an adapter's name, one for all or one per start, as
    generate's. yield_check, on_yield, on_done: generate's (LLM's module docstring), asked
    between steps (not while the loop waits on callbacks); a yield frees parked episodes' blocks
    too. Bad starts, sampling parameters or adapters raise one InvalidRequestError, and nothing
    runs."""
    if not callable(on_turn):
        raise TypeError(f"run_episodes(on_turn=...) must be a callable, got {type(on_turn).__name__}")
    for name, fn in (("yield_check", yield_check), ("on_yield", on_yield), ("on_done", on_done)):
        if fn is not None and not callable(fn):
            raise TypeError(f"run_episodes({name}=...) must be a callable or None, got {type(fn).__name__}")
    _check("max_workers", max_workers, 1, False)
    if llm.asleep:
        raise RuntimeError("the engine is asleep (its KV pool is released): call llm.wake() first")
    items = [starts] if isinstance(starts, dict) else list(starts)
    max_turns = _per_start("max_turns", max_turns, len(items))
    max_episode_tokens = _per_start("max_episode_tokens", max_episode_tokens, len(items))
    resolved = []
    for i, p in enumerate(items):
        if isinstance(p, str) or (isinstance(p, dict) and "prompt_token_ids" not in p):
            resolved.append((p, None, "an episode starts from token ids: a list of ints or {'prompt_token_ids': ...}"))
        else:
            resolved.append((p, *llm._resolve(i, p)))
    llm._sync_lora()
    slot = llm._lora_slots(lora, len(resolved))
    resolved = [(p, None, f"ValueError: {s}") if isinstance(s, str) and err is None else (p, ids, err)
                for (p, ids, err), s in zip(resolved, slot)]
    checked, _ = requests.validate(resolved, sampling_params, "raise")
    llm.block_manager.drop_cache()  # the weights may have changed since the last call
    seqs = requests.make_sequences(resolved, checked, frozenset(llm.eos_token_ids))
    episodes, base, limit = [], {}, []
    for s in seqs:
        i, n = s.request_id, checked[s.request_id].n
        base[i] = len(episodes)
        most = max_episode_tokens[i]
        cap = llm.max_model_len if most is None else min(llm.max_model_len, len(s) + most)
        limit.append(cap)
        s.parks, s.max_len, s.lora = True, min(s.max_len, cap), slot[i]
        episodes += [Episode(len(episodes) + j, i, j, list(s.token_ids)) for j in range(n)]
        llm.scheduler.add(s)
    pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rlcu-episode")
    loop = EpisodeLoop(llm.scheduler, llm.runner, episodes, base, on_turn, pool, lookahead=llm.async_scheduling,
                       max_turns=max_turns, limit=limit, vocab_size=llm.model.cfg.vocab_size,
                       yield_check=yield_check, do_yield=lambda: llm._yield(on_yield, loop.tokens_left))
    try:
        with Progress(len(episodes), use_tqdm, "episodes", "episodes") as bar:
            loop.run(bar.update)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    loop.stats.output_tokens = sum(ep.num_model_tokens for ep in episodes)
    llm.stats = loop.stats.as_dict()
    llm.stats["episodes"] = dataclasses.asdict(loop.ep_stats)
    if any(ep.finish_reason is None for ep in episodes):
        raise RuntimeError("run_episodes ended with an episode unfinished (a bug: please report it)")
    if on_done is not None:
        on_done()
    return episodes
