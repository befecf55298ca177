"""verifiers environments under rlcu's GRPO (rlcu.tools.verifiers_env): a MultiTurnEnv of the
0.1 - 0.2 API (sync, is_completed(messages, state), env_response -> (message, state)) named as
'verifiers:ENV_ID', and one of the 0.3 API (async, is_completed(state), env_response -> messages,
a rubric group) passed as an object, run as episodes whose environment tokens are the chat
template's; rewards from their rubrics. verifiers itself is a fake module here: the installable
0.4 has no MultiTurnEnv any more (verifiers.v1) and its 0.3 needs `verifiers[all]`."""

import sys
import types

import pytest
from support.episode_trainer import trainer
from support.episodes_ref import ScriptedLLM

from rlcu.config import ConfigError

SEEN = {}


class Rubric:
    def __init__(self, funcs=(), weights=None, rubrics=None):
        self.funcs, self.weights = list(funcs), list(weights or [1.0] * len(funcs))
        if rubrics is not None:
            self.rubrics = rubrics


def said_seven(completion, answer, prompt, **kw):
    SEEN.update(completion=completion, answer=answer, prompt=prompt, state=kw.get("state"))
    return float(completion[-1]["content"] == "7")


def turns(state):  # a metric: weight 0
    return float(state["turn"])


class Guess:
    """0.1 - 0.2: asks again until the model says 7."""

    max_turns = 4
    rubric = Rubric([said_seven, turns], [1.0, 0.0])

    def is_completed(self, messages, state, **kw):
        return messages[-1]["content"] == "7"

    def env_response(self, messages, state, **kw):
        state["asked"] = state.get("asked", 0) + 1
        return {"role": "user", "content": "again"}, state


class GuessV3:
    """0.3: async, is_completed(state), env_response -> messages; its rubric a group."""

    max_turns = -1

    def __init__(self):
        async def seven(completion):
            return float(completion[-1]["content"] == "7")

        self.rubric = Rubric(rubrics=[Rubric([seven], [2.0]), Rubric([turns], [0.0])])

    async def setup_state(self, state):
        state["setup"] = True
        return state

    async def is_completed(self, state, **kw):
        return len(state["trajectory"]) >= 2

    async def env_response(self, messages, state, **kw):
        return [{"role": "user", "content": "again"}]


@pytest.fixture
def fake_verifiers(monkeypatch):
    vf = types.ModuleType("verifiers")
    vf.load_environment = lambda env_id, **kw: {"guess": Guess}[env_id]()
    monkeypatch.setitem(sys.modules, "verifiers", vf)
    return vf


def test_a_verifiers_env_by_id_runs_as_episodes_scored_by_its_rubric(tmp_path, fake_verifiers):
    tr, tok = trainer(tmp_path, rewards=[], environment=None, multi_turn=dict(environment="verifiers:guess"))
    end, d = tok.eos_token_id, tok.token_to_id
    llm = ScriptedLLM([[d("5"), end], [d("3"), end], [d("7"), end]])
    s = tr.episodes.sample(llm, tr.rows[:1], [tr.rows[0]["prompt"]], n=2, temperature=1.0, max_tokens=4, seed=0)[0]
    env = tok.encode("\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    assert s.completion_ids == [d("5"), end, *env, d("3"), end, *env, d("7"), end]  # token in, token out
    assert s.model_mask == [1, 1] + [0] * len(env) + [1, 1] + [0] * len(env) + [1, 1]
    assert [m["role"] for m in s.messages] == ["assistant", "user", "assistant", "user", "assistant"]
    assert s.episode["env_reward"] == 1.0 and s.episode["turns"] == 3
    assert SEEN["answer"] == tr.rows[0]["answer"] and SEEN["prompt"] == [{"role": "user",
                                                                          "content": tr.rows[0]["prompt"]}]
    assert SEEN["state"]["asked"] == 2 and SEEN["completion"] == s.messages


def test_a_verifiers_03_env_object_async_with_a_rubric_group(tmp_path, fake_verifiers):
    tr, tok = trainer(tmp_path, rewards=[], environment=GuessV3())
    end, d = tok.eos_token_id, tok.token_to_id
    llm = ScriptedLLM([[d("5"), end], [d("7"), end], [d("7"), end]])
    s = tr.episodes.sample(llm, tr.rows[:1], [tr.rows[0]["prompt"]], n=1, temperature=1.0, max_tokens=4, seed=0)[0]
    assert s.episode["turns"] == 2 and s.episode["env_reward"] == 2.0 and s.episode["error"] is None


def test_a_verifiers_without_the_multi_turn_api_is_refused_by_name(tmp_path, fake_verifiers):
    del fake_verifiers.load_environment
    with pytest.raises(ConfigError, match="multi_turn.environment 'verifiers:guess': verifiers .* has no "
                                          "load_environment"):
        trainer(tmp_path, rewards=[], environment=None, multi_turn=dict(environment="verifiers:guess"))
    with pytest.raises(ConfigError, match="not a verifiers multi-turn environment"):
        trainer(tmp_path, rewards=[], environment=None, multi_turn=dict(environment="verifiers:support.trainers:tiny"))
