"""A reference of the engine's episode contract over LLM.generate, which the multi-turn rollout
tests develop against until LLM.run_episodes lands (it prefills the whole trajectory again each
turn: fine for tests):

    run_episodes(llm, starts, sampling_params, on_turn, *, max_workers, max_turns, max_episode_tokens)
        -> [Episode(start_ids, ids, model_mask, logprobs, turns, finish_reason, env_time_s, error)]

on_turn(i, turn_ids, finish_reason) returns the environment's tokens, or None when episode i is over.
SamplingParams.n > 1 runs n episodes of a start (episode j seeded sample_seed(seed, j), as the
engine seeds them); turn t of an episode draws with its seed + t."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

from rlcu.engine.params import sample_seed


@dataclasses.dataclass
class Episode:
    start_ids: list[int]
    ids: list[int]
    model_mask: list[int]
    logprobs: list[float]
    turns: int
    finish_reason: str | None
    env_time_s: float = 0.0
    error: str | None = None


def _episode(llm, i, start, sp, on_turn, max_turns, max_episode_tokens) -> Episode:
    ep = Episode(start, [], [], [], 0, None)
    while True:
        left = None if max_episode_tokens is None else max_episode_tokens - len(ep.ids)
        budget = sp.max_tokens if left is None else min(sp.max_tokens, left)
        if budget < 1:
            ep.finish_reason = "length"
            return ep
        p = dataclasses.replace(sp, max_tokens=budget, seed=None if sp.seed is None else sp.seed + ep.turns)
        c = llm.generate([{"prompt_token_ids": ep.start_ids + ep.ids}], p, use_tqdm=False)[0].outputs[0]
        toks = list(c.token_ids)
        ep.ids += toks
        ep.model_mask += [1] * len(toks)
        ep.logprobs += list(c.logprobs) if c.logprobs is not None else [0.0] * len(toks)
        ep.turns += 1
        ep.finish_reason = c.finish_reason
        t0 = time.perf_counter()
        env = on_turn(i, toks, c.finish_reason)
        ep.env_time_s += time.perf_counter() - t0
        if env is None or (max_turns is not None and ep.turns >= max_turns):
            return ep
        ep.ids += env
        ep.model_mask += [0] * len(env)
        ep.logprobs += [0.0] * len(env)


def run_episodes(llm, starts, sampling_params, on_turn, *, max_workers=32, max_turns=None, max_episode_tokens=None):
    sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(starts)
    out = []
    for start, sp in zip(starts, sps):
        for j in range(sp.n):
            seed = None if sp.seed is None else sample_seed(sp.seed, j)
            out.append(_episode(llm, len(out), list(start), dataclasses.replace(sp, n=1, seed=seed), on_turn,
                                max_turns, max_episode_tokens))
    return out


class ScriptedLLM:
    """An engine stand-in whose turns are given: turn t of every episode samples `turns[t]` (the
    last one again past the end), each token with logprob -0.5 - t, finishing with `finish`."""

    def __init__(self, turns: list[list[int]], finish: str = "stop"):
        self.turns, self.finish = turns, finish
        self._starts: set[tuple] = set()
        self._t = 0

    def generate(self, prompts, sp, use_tqdm=False):
        ids = tuple(prompts[0]["prompt_token_ids"])
        self._t = 0 if ids in self._starts else self._t + 1
        toks = self.turns[min(self._t, len(self.turns) - 1)][: sp.max_tokens]
        c = SimpleNamespace(token_ids=toks, logprobs=[-0.5 - self._t] * len(toks), finish_reason=self.finish)
        return [SimpleNamespace(outputs=[c])]

    def run_episodes(self, starts, sampling_params, on_turn, **kw):
        self._starts = {tuple(s) for s in starts}
        return run_episodes(self, starts, sampling_params, on_turn, **kw)


def run_episodes_batched(llm, starts, sampling_params, on_turn, *, max_workers=32, max_turns=None,
                         max_episode_tokens=None):
    """run_episodes' contract with the open episodes' turns in one LLM.generate call per round
    (each still prefilled whole): the same prompts and seeds, fast enough for a learning test."""
    sps = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(starts)
    eps, params = [], []
    for start, sp in zip(starts, sps):
        for j in range(sp.n):
            eps.append(Episode(list(start), [], [], [], 0, None))
            params.append(dataclasses.replace(sp, n=1, seed=None if sp.seed is None else sample_seed(sp.seed, j)))
    open_ = list(range(len(eps)))
    while open_:
        todo, ps = [], []
        for i in open_:
            ep, sp = eps[i], params[i]
            left = None if max_episode_tokens is None else max_episode_tokens - len(ep.ids)
            budget = sp.max_tokens if left is None else min(sp.max_tokens, left)
            if budget < 1:
                ep.finish_reason = "length"
                continue
            todo.append(i)
            ps.append(dataclasses.replace(sp, max_tokens=budget, seed=None if sp.seed is None else sp.seed + ep.turns))
        outs = llm.generate([{"prompt_token_ids": eps[i].start_ids + eps[i].ids} for i in todo], ps, use_tqdm=False)
        open_ = []
        for i, o in zip(todo, outs):
            ep, c = eps[i], o.outputs[0]
            toks = list(c.token_ids)
            ep.ids += toks
            ep.model_mask += [1] * len(toks)
            ep.logprobs += list(c.logprobs) if c.logprobs is not None else [0.0] * len(toks)
            ep.turns += 1
            ep.finish_reason = c.finish_reason
            t0 = time.perf_counter()
            env = on_turn(i, toks, c.finish_reason)
            ep.env_time_s += time.perf_counter() - t0
            if env is None or (max_turns is not None and ep.turns >= max_turns):
                continue
            ep.ids += env
            ep.model_mask += [0] * len(env)
            ep.logprobs += [0.0] * len(env)
            open_.append(i)
    return eps
