"""Multi-turn GRPO (issue 36) on the CPU twins: an episode's trajectory packed with loss mask 1 on
the model's tokens only (the environment's carry no loss and no logprob), rewards from the
environment and from a function that receives the conversation as TRL passes it, the
multi_turn config's errors naming their fields, and one multi-turn GRPO step end to end. The
engine's episodes come from support.episodes_ref until LLM.run_episodes lands."""

import dataclasses
import math

import pytest
import torch
from support.episode_trainer import Again, trainer
from support.episodes_ref import ScriptedLLM
from support.episodes_ref import run_episodes as ref_run_episodes
from support.trainers import TINY

from rlcu.config import ConfigError, GRPOConfig, _build
from rlcu.engine import LLM
from rlcu.train import rollout as ro


@pytest.fixture
def engine_episodes(monkeypatch):
    if not hasattr(LLM, "run_episodes"):
        monkeypatch.setattr(LLM, "run_episodes", lambda self, *a, **k: ref_run_episodes(self, *a, **k), raising=False)


def test_three_turn_trajectory_has_loss_mask_on_model_tokens_only(tmp_path):
    tr, tok = trainer(tmp_path, rewards=[])
    end, d = tok.eos_token_id, tok.token_to_id
    llm = ScriptedLLM([[d("3"), d("5"), end], [d("5"), end], [d("7"), d("3"), end]])
    s = tr.episodes.sample(llm, tr.rows[:1], [tr.rows[0]["prompt"]], n=1, temperature=1.0, max_tokens=4, seed=0)[0]
    env = tok.encode("\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    assert s.completion_ids == [d("3"), d("5"), end, *env, d("5"), end, *env, d("7"), d("3"), end]
    assert s.model_mask == [1, 1, 1] + [0] * len(env) + [1, 1] + [0] * len(env) + [1, 1, 1]
    assert s.episode["turns"] == 3 and s.episode["truncated"] is None and s.episode["env_reward"] == 1.0
    assert [m["role"] for m in s.messages] == ["assistant", "user", "assistant", "user", "assistant"]
    b = ro.pack([s, s], torch.tensor([True, False]))
    P, C = len(s.prompt_ids), len(s.completion_ids)
    assert b.tokens[: P + C].tolist() == s.prompt_ids + s.completion_ids  # the forward's whole trajectory
    mask = b.mask[: P + C]
    assert mask.tolist() == [0.0] * P + [float(m) for m in s.model_mask] and float(b.mask[len(mask):].sum()) == 0
    lp = b.old_lp[P : P + C].tolist()
    assert [x for x, m in zip(lp, s.model_mask) if not m] == [0.0] * (2 * len(env))
    assert [x for x, m in zip(lp, s.model_mask) if m] == [-0.5] * 3 + [-1.5] * 2 + [-2.5] * 3


def test_rewards_from_the_environment_and_from_a_function_given_the_conversation(tmp_path):
    seen = {}

    def said_again(prompts, completions, **kw):
        seen.update(prompts=prompts, completions=completions)
        return [0.5 * sum(m["role"] == "user" for m in c) for c in completions]

    tr, tok = trainer(tmp_path, rewards=[said_again])
    end, d = tok.eos_token_id, tok.token_to_id
    llm = ScriptedLLM([[d("7"), end]])
    ss = tr.episodes.sample(llm, tr.rows[:2], [r["prompt"] for r in tr.rows[:2]], n=2, temperature=1.0,
                            max_tokens=4, seed=0)
    m = tr.score(ss)
    assert [s.reward for s in ss] == [2.0] * 4  # the environment's 1 + 0.5 for each of its two replies
    assert seen["prompts"][0] == [{"role": "user", "content": tr.rows[0]["prompt"]}]
    assert seen["completions"][0] == [{"role": "assistant", "content": "7"}, {"role": "user", "content": "again"},
                                      {"role": "assistant", "content": "7"}, {"role": "user", "content": "again"},
                                      {"role": "assistant", "content": "7"}]
    assert m["reward/env"] == 1.0 and m["reward/said_again"] == 1.0
    assert m["episodes/turns"] == 3 and m["episodes/turns_max"] == 3 and m["episodes/tool_calls"] == 0
    assert m["episodes/truncated_max_turns"] == 0 and m["episodes/failed"] == 0

    class Broken(Again):
        def reward(self, messages):
            raise ValueError("no score")

    tr.episodes.spec.cls = Broken
    ss = tr.episodes.sample(llm, tr.rows[:1], [tr.rows[0]["prompt"]], n=2, temperature=1.0, max_tokens=4, seed=0)
    tr.score(ss)
    assert all(math.isnan(s.reward) for s in ss) and "ValueError: no score" in ss[0].episode["error"]


def test_multi_turn_config_errors_name_the_field(tmp_path):
    base = dict(model=dict(tiny=dict(TINY, vocab_size=40)), log=dict(out_dir=str(tmp_path)))
    cases = [({"multi_turn": {"environment": "no_colon"}}, "multi_turn.environment must be 'module.path:Class'"),
             ({"multi_turn": {"tools": ["fn"]}}, r"multi_turn.tools\[0\] must be 'module.path:function'"),
             ({"multi_turn": {"max_turns": 0}}, "multi_turn.max_turns must be >= 1"),
             ({"multi_turn": {"tool_timeout_s": 0}}, "multi_turn.tool_timeout_s must be > 0"),
             ({"multi_turn": {"tool": []}}, "multi_turn.tool"),
             ({"rewards": []}, "rewards is empty: give a reward function, or a multi_turn.environment"),
             ({"multi_turn": {"tools": ["rlcu.tools:python"]}, "chat_template": False},
              "multi_turn needs chat_template: true")]
    for extra, msg in cases:
        with pytest.raises(ConfigError, match=msg):
            _build(GRPOConfig, {**base, **extra})
    with pytest.raises(ConfigError, match="multi_turn.environment 'nowhere_env:Env': cannot import module"):
        trainer(tmp_path, environment=None, multi_turn=dict(environment="nowhere_env:Env"))
    with pytest.raises(ConfigError, match=r"multi_turn.tools\[0\] 'rlcu.tools:nothing': module 'rlcu.tools' has no"):
        trainer(tmp_path, environment=None, multi_turn=dict(tools=["rlcu.tools:nothing"]))

    class Silent:
        def step(self, messages):
            return None

    with pytest.raises(ConfigError, match="rewards is empty, and the environment Silent has no reward"):
        trainer(tmp_path, environment=Silent, rewards=[], multi_turn=dict(environment="support.trainers:TINY"))


def words_said(completions, **_):
    """The words of the model's turns: a reward that differs within a group."""
    return [float(sum(len(m["content"].split()) for m in c if m["role"] == "assistant")) for c in completions]


def test_one_multi_turn_grpo_step_runs_end_to_end(tmp_path, engine_episodes):
    tr, _ = trainer(tmp_path, eos_digits=True, steps=1, rewards=[words_said], max_new_tokens=3, prompts_per_step=2)
    before = tr.model.flat.detach().clone()
    hist = tr.train()
    m = hist[-1]
    assert m["episodes/turns_max"] >= 2 and 1 <= m["episodes/turns"] <= 3
    assert math.isfinite(m["loss"]) and not torch.equal(before, tr.model.flat)
    assert m["adv_abs"] > 0 and "episodes/tool_time_s" in m


def test_a_groups_episodes_share_one_start_unless_reset_differs(tmp_path):
    class Recording(ScriptedLLM):
        def run_episodes(self, starts, sampling_params, on_turn, **kw):
            self.seen = (starts, sampling_params)
            return super().run_episodes(starts, sampling_params, on_turn, **kw)

    class Counter(Again):
        made = 0

        def reset(self, row):
            Counter.made += 1
            return f"sort {Counter.made % 10} :"

    tr, tok = trainer(tmp_path, rewards=[words_said])
    llm = Recording([[tok.token_to_id("7"), tok.eos_token_id]])
    ss = tr.episodes.sample(llm, tr.rows[:2], [r["prompt"] for r in tr.rows[:2]], n=3, temperature=1.0,
                            max_tokens=4, seed=0)
    starts, sps = llm.seen
    assert len(ss) == 6 and len(starts) == 2 and [sp.n for sp in sps] == [3, 3]
    assert [s.group for s in ss] == [0, 0, 0, 1, 1, 1] and ss[3].prompt_ids == starts[1]
    tr.episodes.spec.cls = Counter
    ss = tr.episodes.sample(llm, tr.rows[:2], [r["prompt"] for r in tr.rows[:2]], n=3, temperature=1.0,
                            max_tokens=4, seed=0)
    starts, sps = llm.seen
    assert len(starts) == 6 and [sp.n for sp in sps] == [1] * 6 and len({sp.seed for sp in sps}) == 6
    assert [s.prompt_messages[-1]["content"] for s in ss] == [f"sort {k % 10} :" for k in range(1, 7)]


def test_overlong_penalty_and_mask_count_an_episodes_model_tokens_against_its_room(tmp_path):
    """Three turns of 3 + 2 + 3 model tokens between two 6-token user replies: the penalty reads 8
    model tokens against the 22 - 12 = 10 its episode left them (buffer 4: -0.5), not its 20 tokens
    against max_new_tokens; masking drops an episode cut by length, not one ended by max_turns."""
    tr, tok = trainer(tmp_path, rewards=[], max_new_tokens=4, overlong="penalty", overlong_buffer=4,
                      prompts_per_step=1, group_size=2, multi_turn=dict(max_episode_tokens=22))
    end, d = tok.eos_token_id, tok.token_to_id
    llm = ScriptedLLM([[d("3"), d("5"), end], [d("5"), end], [d("7"), d("3"), end]])
    tr.rollout = lambda rows, n, seed, group_offset=0: tr.episodes.sample(
        llm, rows, [r["prompt"] for r in rows], n=n, temperature=1.0, max_tokens=4, seed=seed)
    ss, keep, _ = tr._collect(0)
    s = ss[0]
    assert len(s.completion_ids) == 20 and s.episode["model_tokens"] == 8 and s.episode["model_room"] == 10
    assert [x.reward for x in ss] == [0.5, 0.5]  # the environment's 1, less 0.5
    tr.cfg.overlong = "mask"
    tr.episodes.limits = dataclasses.replace(tr.episodes.limits, max_turns=2)
    ss, keep, _ = tr._collect(1)
    assert ss[0].episode["truncated"] == "max_turns" and keep.tolist() == [True, True]
    llm.turns, llm.finish = [[d("3"), d("5"), d("5"), d("5")]], "length"  # cut at max_new_tokens
    ss, keep, _ = tr._collect(2)
    assert ss[0].episode["truncated"] == "length" and keep.tolist() == [False, False]


def test_a_preemptible_jobs_episodes_yield_the_device_and_change_nothing(tmp_path):
    """The trainer passes a scheduler's hooks (yield_check, on_yield, on_generate_done) to
    run_episodes as it does to generate: every second engine step the rollout gives the device back
    (the engine asleep in on_yield), and in exact mode the episodes are an unhooked rollout's, bit
    for bit."""
    from rlcu.train.core import Hooks

    class YieldEvery3(Hooks):
        preemptible = True

        def __init__(self):
            self.asked, self.yielded, self.done = 0, [], 0

        def yield_check(self):
            self.asked += 1
            return self.asked % 2 == 0

        def on_yield(self, tokens_left):
            self.yielded.append((tr.llm.asleep, tokens_left))

        def on_generate_done(self):
            self.done += 1

    tr, _ = trainer(tmp_path, eos_digits=True, rewards=[words_said], max_new_tokens=3, exact=True)
    rows = tr.rows[:2]

    def roll():
        ss = tr._engine_phase(lambda: tr.rollout(rows, 2, seed=7))
        return [(s.completion_ids, s.logprobs, s.model_mask) for s in ss]

    want = roll()
    h = tr.hooks = YieldEvery3()
    got = roll()
    assert len(h.yielded) >= 2 and all(asleep for asleep, _ in h.yielded) and h.done == 1
    assert max(sum(m) for _, _, m in want) > 3  # some episode ran more than one turn
    assert got == want


def test_the_schedulers_work_estimate_counts_turns_environment_tokens_and_its_wait(tmp_path):
    """The rollout's work (the scheduler's split of spare devices weighs jobs by it) in decoded
    tokens: turns x max_new_tokens within the episode's tokens, the environment's rest of them at
    PREFILL_WORK, and after a rollout the environment's measured wait at the rollout's rate."""
    import time

    from rlcu.train.episodes import PREFILL_WORK, episode_work

    assert episode_work(8, 16, 4, 100) == 8 * (64 + PREFILL_WORK * 36)
    assert episode_work(8, 16, 4, 40) == 8 * 40  # the model's turns may fill the episode
    assert episode_work(8, 16, 1, 100) == 8 * 16  # one turn: a completion's work
    assert episode_work(8, 16, 4, 100, env_time_s=0.5, tokens_per_s=200) == 8 * (64 + PREFILL_WORK * 36) + 100

    class Slow(Again):
        def step(self, messages):
            time.sleep(0.05)
            return super().step(messages)

    tr, tok = trainer(tmp_path, rewards=[words_said], max_new_tokens=3, environment=Slow)
    n = tr.cfg.prompts_per_step * tr.cfg.group_size
    before = tr._rollout_work()
    assert before == episode_work(n, 3, 4, 40) == n * (12 + PREFILL_WORK * 28)  # the config's bound
    llm = ScriptedLLM([[tok.token_to_id("7"), tok.eos_token_id]])
    tr.episodes.sample(llm, tr.rows[:1], [tr.rows[0]["prompt"]], n=2, temperature=1.0, max_tokens=3, seed=0)
    ep = tr.episodes
    assert ep.env_time_s >= 3 * 0.05 and ep.tokens_per_s > 0  # three steps of the environment each
    assert tr._rollout_work() == pytest.approx(before + ep.env_time_s * ep.tokens_per_s)
