"""A real verifiers multi-turn environment under rlcu's GRPO (rlcu.tools.verifiers_env): a guessing
game the test defines with verifiers' own classes (vf.MultiTurnEnv, @vf.stop, vf.Rubric), run by
its own rollout with rlcu's engine as its model: token in, token out, rewards from its rubric, its
stop conditions and max_turns, rlcu's limits ending its rollout, and one GRPO step end to end.
Needs verifiers 0.2 - 0.3 (the `verifiers` extra); the refusal of a verifiers without the
MultiTurnEnv API (0.4) is checked with a stand-in module, which no installed verifiers can be."""

import math
import sys
import types

import pytest
from support.episode_trainer import trainer
from support.episodes_ref import ScriptedLLM

from rlcu.config import ConfigError

SEEN = {}


def test_a_verifiers_without_the_multi_turn_api_is_refused_by_name(tmp_path, monkeypatch):
    v1 = types.ModuleType("verifiers")  # 0.4: verifiers.v1, no MultiTurnEnv
    v1.__version__ = "0.4.0"
    monkeypatch.setitem(sys.modules, "verifiers", v1)
    with pytest.raises(ConfigError, match="multi_turn.environment 'verifiers:guess': verifiers 0.4.0 has no "
                                          "MultiTurnEnv or Client .*verifiers 0.2 - 0.3"):
        trainer(tmp_path, rewards=[], environment=None, multi_turn=dict(environment="verifiers:guess"))
    with pytest.raises(ConfigError, match="not a verifiers multi-turn environment"):
        trainer(tmp_path, rewards=[], environment=None, multi_turn=dict(environment="verifiers:support.trainers:tiny"))


def _vf():
    vf = pytest.importorskip("verifiers")
    try:
        vf.MultiTurnEnv  # noqa: B018 - 0.3 serves it lazily; 0.4 has none
    except AttributeError:
        pytest.skip(f"verifiers {vf.__version__} has no MultiTurnEnv (rlcu runs 0.2 - 0.3)")
    return vf


def guess_env(rows, max_turns=4):
    """A guessing game in verifiers' own terms: the user says 'again' until the model says 7 (its
    @vf.stop), at most max_turns model turns; the rubric pays 2 for a 7 and 0.1 a word said."""
    vf = _vf()
    from datasets import Dataset

    class Guess(vf.MultiTurnEnv):
        async def setup_state(self, state):
            state["asked"] = 0
            return state

        @vf.stop
        async def guessed(self, state):
            return bool(state["trajectory"]) and state["trajectory"][-1]["completion"][-1]["content"] == "7"

        async def env_response(self, messages, state, **kw):
            state["asked"] += 1
            return [vf.UserMessage(content="again")]

    async def said_seven(completion, answer, state):
        SEEN.update(completion=completion, answer=answer, state=state)
        return float(completion[-1]["content"] == "7")

    def words(completion):
        return float(sum(len((m["content"] or "").split()) for m in completion if m["role"] == "assistant"))

    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                            for r in rows])
    return Guess(dataset=ds, rubric=vf.Rubric(funcs=[said_seven, words], weights=[2.0, 0.1]), max_turns=max_turns)


def test_a_verifiers_guessing_game_runs_as_episodes_scored_by_its_rubric(tmp_path):
    from rlcu.data import synthetic as syn

    rows = syn.sort_rows(16, "train", min_len=2, max_len=3)
    tr, tok = trainer(tmp_path, rewards=[], environment=guess_env(rows))
    end, d = tok.eos_token_id, tok.token_to_id
    sample = lambda llm: tr.episodes.sample(llm, tr.rows[:1], [tr.rows[0]["prompt"]], n=2, temperature=1.0,  # noqa: E731
                                            max_tokens=4, seed=0)
    s = sample(ScriptedLLM([[d("5"), end], [d("3"), end], [d("7"), end]]))[0]
    env = tok.encode("\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    assert s.completion_ids == [d("5"), end, *env, d("3"), end, *env, d("7"), end]  # token in, token out
    assert s.model_mask == [1, 1] + [0] * len(env) + [1, 1] + [0] * len(env) + [1, 1]
    assert [m["role"] for m in s.messages] == ["assistant", "user", "assistant", "user", "assistant"]
    assert s.episode["turns"] == 3 and s.episode["error"] is None
    assert s.episode["env_reward"] == pytest.approx(2.0 + 0.3)  # 2 x said_seven + 0.1 x 3 words
    st = SEEN["state"]  # the rollout's own state: setup_state, env_response, its stop, its cleanup's render
    assert st["asked"] == 2 and st["stop_condition"] == "guessed" and SEEN["answer"] == tr.rows[0]["answer"]
    assert [m["content"] for m in SEEN["completion"]] == [m["content"] for m in s.messages]
    assert st["prompt"][0]["content"] == tr.rows[0]["prompt"]

    s = sample(ScriptedLLM([[d("5"), end]]))[1]  # never guessed: the environment's max_turns ends it
    assert s.episode["turns"] == 4 and s.episode["truncated"] is None
    assert s.episode["env_reward"] == pytest.approx(0.4) and SEEN["state"]["stop_condition"] == "max_turns_reached"

    tr, tok = trainer(tmp_path, rewards=[], environment=guess_env(rows), multi_turn=dict(max_turns=2))
    s = sample(ScriptedLLM([[d("5"), end]]))[0]  # rlcu's max_turns ends it first: the rollout ends as too long
    assert s.episode["turns"] == 2 and s.episode["truncated"] == "max_turns"
    assert s.episode["env_reward"] == pytest.approx(0.2) and SEEN["state"]["prompt_too_long"]


def test_one_grpo_step_of_a_verifiers_environment(tmp_path):
    from rlcu.data import synthetic as syn

    env = guess_env(syn.sort_rows(16, "train", min_len=2, max_len=3), max_turns=3)
    tr, _ = trainer(tmp_path, eos_digits=True, steps=1, rewards=[], environment=env, max_new_tokens=3,
                    prompts_per_step=2)
    before = tr.model.flat.detach().clone()
    m = tr.train()[-1]
    assert 1 <= m["episodes/turns"] <= 3 and m["episodes/failed"] == 0
    assert math.isfinite(m["loss"]) and m["adv_abs"] > 0 and not (before == tr.model.flat).all()
