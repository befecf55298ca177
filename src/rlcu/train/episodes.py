"""Multi-turn rollouts: G episodes per prompt through the engine's `LLM.run_episodes`, each a
`rlcu.tools.episode.EpisodeState` whose turn callback runs the tools (or the environment's step)
and returns the environment's tokens, rendered by the chat template (rlcu.tools.render).

An episode becomes a `Sample` whose completion is the engine's sampled tokens interleaved with the
environment's, as ids end to end (never re-tokenised), with `model_mask` 1 on the model's tokens:
`rollout.pack` gives the environment's tokens mask 0 (no loss) and logprob 0, and the trainer's
forward runs over the whole trajectory. The environment's `reward(messages)` is taken after the
episode (`episode["env_reward"]`); reward functions get the conversation as TRL passes it
(`prompts`: the start messages, `completions`: every message after them).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from rlcu.config import ConfigError
from rlcu.engine import SamplingParams
from rlcu.engine.params import sample_seed
from rlcu.rewards.call import describe
from rlcu.tools.environment import Environment
from rlcu.tools.episode import EpisodeLimits, EpisodeState
from rlcu.tools.render import TurnRenderer
from rlcu.train.rollout import Sample, stop_ids

PREFILL_WORK = 0.125  # an environment token's work in decoded tokens (episode_work says why)


def make_runner(cfg, tokenizer, model, environment=None, tools=None, reward_fns: bool = True) -> EpisodeRunner | None:
    """The run's episodes from cfg.multi_turn, `environment` and `tools` (the trainer's Python
    arguments) winning over its fields; None for single-turn completions. reward_fns: the run
    has reward functions (else the environment must score the episodes)."""
    mt = getattr(cfg, "multi_turn", None)
    if mt is None:
        if environment is not None or tools:
            raise ConfigError("multi_turn", "episodes with an environment or tools need a multi_turn section (GRPO's "
                                           "and PPO's configs; this trainer's has none)")
        return None
    env = environment if environment is not None else mt.environment
    tools = tools if tools is not None else mt.tools
    if env is None and not tools:
        return None
    try:
        spec = Environment(env, tools)
    except ValueError as e:  # "environment ...: ..." or "tools[i] ...: ..."
        raise ConfigError("", f"multi_turn.{e}") from None
    if not reward_fns and not spec.has("reward"):
        raise ConfigError("rewards", f"is empty, and the environment {getattr(spec.cls, '__name__', None)} has no "
                                     f"reward(messages): give a reward function or an environment that scores")
    limits = EpisodeLimits(mt.max_turns, mt.max_episode_tokens, mt.tool_timeout_s)
    return EpisodeRunner(spec, tokenizer, model.cfg.family, limits, stop_ids=stop_ids(tokenizer, model),
                         template_kwargs=cfg.data.chat_template_kwargs, max_workers=mt.tool_workers,
                         context=model.cfg.max_position_embeddings)


class EpisodeRunner:
    """A run's episodes: the environment `spec`, the chat rendering (the tools' schemas go to the
    template, as for the prompt), the model `family` (its tool-call format), the limits, and the
    model's context (an episode never runs past it)."""

    def __init__(self, spec: Environment, tokenizer, family: str, limits: EpisodeLimits, *, stop_ids=(),
                 template_kwargs: dict | None = None, max_workers: int = 32, context: int | None = None):
        self.spec, self.family, self.limits = spec, family, limits
        self.renderer = TurnRenderer(tokenizer, spec.schemas or None, template_kwargs, stop_ids)
        self.max_workers, self.context = max_workers, context
        self.env_time_s, self.tokens_per_s = 0.0, 0.0  # the last sample's: env seconds per episode, tokens/s

    def work(self, episodes: int, max_new_tokens: int) -> float:
        """The scheduler's work estimate of `episodes` episodes (episode_work), their tool time
        the environment's time the last call's (none before the first)."""
        return episode_work(episodes, max_new_tokens, self.limits.max_turns, self.limits.max_tokens,
                            self.env_time_s, self.tokens_per_s)

    def start(self, row: dict, prompt) -> EpisodeState:
        st = EpisodeState(self.spec.make(), self.renderer, self.family, row, prompt, self.limits)
        if self.context is not None:  # the episode's room after its start, within the model's context
            room = self.context - len(st.start_ids)
            st.limits = dataclasses.replace(self.limits, max_tokens=min(self.limits.max_tokens or room, room))
        return st

    def sample(self, llm, rows: list[dict], prompts: list, *, n: int, temperature: float, top_p: float = 1.0,
               top_k: int = -1, max_tokens: int, seed: int, stop_token_ids=(), ignore_eos: bool = False,
               group_offset: int = 0, seed_offset: int = 0, generate_kw: dict | None = None) -> list[Sample]:
        """n episodes of each row (consecutive, grouped), as rollout.sample's completions are,
        with the same seeds: episode j of prompt g draws from sample_seed(prompt g's seed, j).
        generate_kw: more arguments of llm.run_episodes (the scheduler's yield_check / on_yield /
        on_done, as rollout.sample passes them to generate), so a scheduled job's episodes yield
        the device between engine steps as its completions do."""
        if not hasattr(llm, "run_episodes"):
            raise RuntimeError("multi_turn: this engine has no LLM.run_episodes (episodes need the engine of "
                               "issue 36)")
        states, starts, sps = [], [], []
        for g, (row, prompt) in enumerate(zip(rows, prompts)):
            s_g = (seed * 1_000_003 + seed_offset + g) % (1 << 62)
            group = [self.start(row, prompt) for _ in range(n)]
            states += group
            room = min(st.limits.max_tokens or max_tokens for st in group)
            sp = dict(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max(1, min(max_tokens, room)),
                      logprobs=temperature > 0, stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
            if all(st.start_ids == group[0].start_ids for st in group):
                # one start, n episodes: they share its prefilled blocks; episode j draws sample_seed(s_g, j)
                starts.append(group[0].start_ids)
                sps.append(SamplingParams(n=n, seed=s_g, **sp))
            else:  # reset(row) made different starts: one each
                starts += [st.start_ids for st in group]
                sps += [SamplingParams(n=1, seed=sample_seed(s_g, j), **sp) for j in range(n)]
        t0 = time.perf_counter()
        eps = llm.run_episodes(starts, sps, lambda i, ids, fr: states[i].on_turn(ids, fr),
                               max_workers=self.max_workers, max_turns=self.limits.max_turns,
                               max_episode_tokens=self.limits.max_tokens, **(generate_kw or {}))
        if len(eps) != len(states):
            raise RuntimeError(f"the engine returned {len(eps)} episodes, expected {len(states)}")
        if states:
            self.env_time_s = sum(getattr(ep, "env_time_s", 0.0) for ep in eps) / len(eps)
            self.tokens_per_s = sum(len(ep.ids) for ep in eps) / max(time.perf_counter() - t0, 1e-9)
        return [self._sample(group_offset + k // n, rows[k // n], st, ep)
                for k, (st, ep) in enumerate(zip(states, eps))]

    def _sample(self, group: int, row: dict, st: EpisodeState, ep) -> Sample:
        ids, mask = list(ep.ids), [int(m) for m in ep.model_mask]
        lps = list(ep.logprobs) if ep.logprobs is not None else [0.0] * len(ids)
        stats = dataclasses.asdict(st.stats)
        err = getattr(ep, "error", None)
        stats["engine_error"] = None if err is None else err if isinstance(err, str) else describe(err)
        stats["env_reward"] = self._env_reward(st, stats)
        # the overlong penalty's length and limit: the model's tokens, and the room the episode's
        # limit left them after its environment tokens (None: no episode limit)
        stats["model_tokens"] = sum(mask)
        lim = st.limits.max_tokens
        stats["model_room"] = None if lim is None else lim - (len(ids) - stats["model_tokens"])
        finish = "length" if st.stats.truncated == "length" else ep.finish_reason
        last = next((m.get("content") or "" for m in reversed(st.messages) if m["role"] == "assistant"), "")
        return Sample(group, list(ep.start_ids), ids, lps, finish, row, completion_text=last, model_mask=mask,
                      messages=st.completion_messages, prompt_messages=st.prompt_messages, episode=stats)

    @staticmethod
    def _env_reward(st: EpisodeState, stats: dict) -> float | None:
        """The environment's reward for the episode; nan (masked) when it or the episode failed."""
        if not st.env.spec.has("reward"):
            return None
        if stats["error"] or stats["engine_error"]:
            return math.nan
        try:
            r = st.env.reward(st.messages)
        except Exception as e:  # noqa: BLE001 - the environment's code: this sample is masked
            stats["error"] = f"reward: {describe(e)}"
            return math.nan
        return r if math.isfinite(r) else math.nan


def episode_work(episodes: int, max_new_tokens: int, max_turns: int | None, max_tokens: int | None,
                 env_time_s: float = 0.0, tokens_per_s: float = 0.0) -> float:
    """The scheduler's estimate of a rollout of `episodes` episodes, in its unit for completions
    (tokens decoded, the most a step may make: prompts x group x max_new_tokens), so that episode
    jobs and completion jobs weigh alike in its split of spare devices:

        episodes x (model + PREFILL_WORK x environment tokens) + env_time_s x tokens_per_s

    - model tokens: max_turns turns of max_new_tokens, within max_tokens (the episode's tokens,
      model's and environment's); the environment's: the rest of max_tokens, which they may fill
      (the most work, since a prefilled token costs less than a decoded one). A decoded token
      takes a step of its own; an environment token is one of a prefill chunk's, whose weights
      are read once for the chunk, so at the batch sizes of a rollout it costs a fraction of a
      decode step's share: PREFILL_WORK = 1/8 is a round figure of that, not a measurement.
    - the environment's wait: the mean seconds an episode waited for its tools or the
      environment's step in the last step (`env_time_s`, the engine's on_turn time) at the
      rollout's rate (`tokens_per_s`, all episodes' tokens over its wall time), as if each
      waiting episode held its decode slot idle; 0 before a step.
    Without max_turns or max_tokens the bound is the one a limit left gives."""
    turns = max(1, max_turns or 1)
    model = turns * max_new_tokens if max_tokens is None else min(turns * max_new_tokens, max_tokens)
    env = 0 if max_tokens is None or turns == 1 else max_tokens - model
    return float(episodes * (model + PREFILL_WORK * env) + max(env_time_s, 0.0) * max(tokens_per_s, 0.0))


def overlong_lengths(samples: list[Sample], max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([n] lengths, [n] limits) the overlong penalty reads: a completion's tokens against
    max_new_tokens; an episode's model tokens against the room its token limit left them after
    its environment's tokens (their count differs per episode), so environment tokens count in
    neither (an episode without a limit: against max_new_tokens)."""
    L, lim = [], []
    for s in samples:
        e = s.episode
        if e is None or "model_tokens" not in e:
            L.append(len(s.completion_ids))
            lim.append(max_new_tokens)
        else:
            L.append(e["model_tokens"])
            lim.append(max_new_tokens if e["model_room"] is None else e["model_room"])
    return torch.tensor(L), torch.tensor(lim)


def episode_metrics(samples: list[Sample]) -> dict:
    """Per step: turns per episode (mean, max), tool calls and tool errors per episode, the
    fraction truncated by max_turns and by length, tool seconds per episode, failed episodes."""
    eps = [s.episode for s in samples if s.episode is not None]
    if not eps:
        return {}
    n = len(eps)
    return {"episodes/turns": sum(e["turns"] for e in eps) / n, "episodes/turns_max": max(e["turns"] for e in eps),
            "episodes/tool_calls": sum(e["tool_calls"] for e in eps) / n,
            "episodes/tool_errors": sum(e["tool_errors"] for e in eps) / n,
            "episodes/truncated_max_turns": sum(e["truncated"] == "max_turns" for e in eps) / n,
            "episodes/truncated_length": sum(e["truncated"] == "length" for e in eps) / n,
            "episodes/tool_time_s": sum(e["tool_time_s"] for e in eps) / n,
            "episodes/failed": float(sum(bool(e["error"] or e["engine_error"]) for e in eps))}


def with_env_rewards(samples: list[Sample], total, breakdown: dict) -> tuple:
    """The reward functions' totals [n] plus the environment's reward where it gives one (`env` in
    the breakdown); a failed episode is masked (nan)."""
    env = [s.episode.get("env_reward") if s.episode is not None else None for s in samples]
    failed = torch.tensor([bool(s.episode and (s.episode["error"] or s.episode["engine_error"])) for s in samples])
    total = total.clone()
    if any(r is not None for r in env):
        r = torch.tensor([math.nan if v is None else v for v in env], dtype=total.dtype)
        total = total + r  # an environment whose reward failed masks its sample
        breakdown = {**breakdown, "env": r}
    total[failed] = math.nan
    return total, breakdown
