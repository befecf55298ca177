"""rlcu.tools: environments from plain Python (tool methods, reset, step, reward, done), and an
episode's turn callback: tool calls parsed and run concurrently under a time limit (a malformed
or failing call an error message to the model), the environment's tokens exactly the chat
template's suffix for Qwen2.5, a Qwen3-flavoured ChatML (not prefix-stable), Llama 3.1 and
Mistral v0.3, and the limits (max_turns, the episode's tokens, a turn cut at max_new_tokens)."""

import time

import pytest
from support.episode_util import Calculator, episode, family_tokenizer, turn

from rlcu.tools import Environment, EnvironmentSpecError, python

CALL = {"qwen2": '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        "llama": '{"name": "add", "parameters": {"a": 2, "b": 3}}',
        "mistral": '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "000100000"}]'}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    return {f: family_tokenizer(f, tmp_path_factory.mktemp(f)) for f in ("qwen2", "qwen3", "llama", "mistral")}


def test_public_methods_and_plain_functions_are_tools():
    def lookup(city: str) -> str:
        """Look a city up.

        Args:
            city: The city.
        """
        return city

    spec = Environment(Calculator, [lookup, "rlcu.tools:python"])
    assert [s["function"]["name"] for s in spec.schemas] == ["lookup", "python", "add", "slow"]
    ep = spec.make()
    assert ep.tools["add"](2, 3) == 5 and ep.obj.calls == 1 and ep.tools["python"] is python
    assert spec.has("reward") and not spec.has("step")


def test_environment_errors_name_what_is_wrong():
    class NoDoc:
        def act(self, x: int) -> int:
            return x

    with pytest.raises(EnvironmentSpecError, match="method act.*no docstring.*prefix a helper's name with _"):
        Environment(NoDoc)
    with pytest.raises(EnvironmentSpecError, match="must be a class"):
        Environment(Calculator())
    with pytest.raises(ValueError, match="environment 'nowhere_mod:Env': cannot import module"):
        Environment("nowhere_mod:Env")
    with pytest.raises(EnvironmentSpecError, match="two tools are named 'add'"):
        Environment(Calculator, [Calculator.add])


def test_python_tool_runs_in_the_sandbox():
    assert python("print(6 * 7)").strip() == "42"
    assert "ZeroDivisionError" in python("1 / 0")


@pytest.mark.parametrize("family", ["qwen2", "llama", "mistral"])
def test_env_tokens_are_the_templates_suffix(toks, family):
    """start + the model's tokens + the environment's = the template's rendering of the whole
    conversation, token for token (these templates are prefix-stable over a tool turn)."""
    tok = toks[family]
    ep = episode(tok, family)
    model = turn(tok, family, CALL[family])
    env = ep.on_turn(model, "stop")
    assert env is not None and ep.stats.tool_calls == 1 and ep.stats.tool_errors == 0
    assert ep.messages[-1]["role"] == "tool" and ep.messages[-1]["content"] == "5"
    msgs = [{"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "id": "000100000", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
            {"role": "tool", "name": "add", "tool_call_id": "000100000", "content": "5"}]
    whole = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tools=ep.renderer.tools))
    assert ep.start_ids + model + env == whole
    assert ep.n_tokens == len(model) + len(env)


def test_qwen3_suffix_with_reasoning_is_not_the_rerendered_conversation(toks):
    """Qwen3's template drops the reasoning of an answered turn once a user reply follows: the
    trajectory keeps the sampled <think> block and only the new tokens are the environment's."""
    tok = toks["qwen3"]

    class Again:
        def step(self, messages):
            return "Check it again."

    ep = episode(tok, "qwen3", Again)
    model = turn(tok, "qwen3", "<think>\nadd them\n</think>\n\nIt is 5.")
    env = ep.on_turn(model, "stop")
    assert tok.decode(env, skip_special_tokens=False) == \
        "\n<|im_start|>user\nCheck it again.<|im_end|>\n<|im_start|>assistant\n"
    rerendered = tok.encode(tok.apply_chat_template(ep.messages, add_generation_prompt=True))
    assert ep.start_ids + model + env != rerendered  # the re-render lost the <think> block
    assert "<think>" in tok.decode(ep.start_ids + model + env, skip_special_tokens=False)


def test_malformed_call_and_failing_tool_become_error_messages(toks):
    tok = toks["qwen2"]
    ep = episode(tok, "qwen2")
    text = ('<tool_call>\n{"name": "add", "arguments": {"a": 2,}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": "two", "b": 3}}\n</tool_call>\n'
            '<tool_call>\n{"name": "sub", "arguments": {}}\n</tool_call>')
    env = ep.on_turn(turn(tok, "qwen2", text), "stop")
    assert env is not None and ep.stats.tool_calls == 3 and ep.stats.tool_errors == 3
    errs = [m["content"] for m in ep.messages if m["role"] == "tool"]
    assert errs[0].startswith("Error: a tool call is not valid JSON")
    assert errs[1].startswith("Error: bad call to add: argument 'a' must be integer")
    assert errs[2].startswith("Error: unknown tool 'sub'")
    assert "Error: a tool call is not valid JSON" in tok.decode(env)

    class Broken:
        def boom(self) -> str:
            """Fail."""
            raise RuntimeError("kaput")

    ep = episode(tok, "qwen2", Broken)
    ep.on_turn(turn(tok, "qwen2", '<tool_call>\n{"name": "boom", "arguments": {}}\n</tool_call>'), "stop")
    assert ep.messages[-1]["content"] == "Error: tool boom failed: RuntimeError: kaput" and ep.stats.error is None


def test_tool_timeout_and_calls_run_concurrently(toks):
    tok = toks["qwen2"]
    ep = episode(tok, "qwen2", tool_timeout_s=0.3)
    call = '<tool_call>\n{"name": "slow", "arguments": {"seconds": %s}}\n</tool_call>'
    t0 = time.perf_counter()
    ep.on_turn(turn(tok, "qwen2", call % 5), "stop")
    assert time.perf_counter() - t0 < 2.0
    assert ep.messages[-1]["content"] == "Error: tool slow timed out after 0.3 s" and ep.stats.tool_errors == 1
    ep = episode(tok, "qwen2", tool_timeout_s=5)
    t0 = time.perf_counter()
    ep.on_turn(turn(tok, "qwen2", "\n".join([call % 0.4] * 4)), "stop")
    assert time.perf_counter() - t0 < 1.2  # four 0.4 s calls at once, not one after another
    assert [m["content"] for m in ep.messages[-4:]] == ["done"] * 4 and ep.stats.tool_time_s >= 0.4


def test_limits_end_the_episode(toks):
    tok = toks["qwen2"]
    call = turn(tok, "qwen2", CALL["qwen2"])
    ep = episode(tok, "qwen2", max_turns=2)
    assert ep.on_turn(call, "stop") is not None
    assert ep.on_turn(call, "stop") is None and ep.stats.truncated == "max_turns" and ep.stats.turns == 2
    ep = episode(tok, "qwen2")
    assert ep.on_turn(turn(tok, "qwen2", "<tool_call>\n{", stop=False), "length") is None
    assert ep.stats.truncated == "length" and ep.stats.tool_calls == 0
    ep = episode(tok, "qwen2", max_tokens=len(call) + 5)
    assert ep.on_turn(call, "stop") is None and ep.stats.truncated == "length"
    assert ep.messages[-1]["role"] == "assistant"  # the tool's result never reached the model


def test_answer_without_calls_ends_and_done_and_step_errors(toks):
    tok = toks["qwen2"]
    ep = episode(tok, "qwen2")
    assert ep.on_turn(turn(tok, "qwen2", "It is 5."), "stop") is None
    assert ep.completion_messages == [{"role": "assistant", "content": "It is 5."}]
    assert ep.env.reward(ep.messages) == 1.0 and ep.stats.truncated is None

    class Once(Calculator):
        def add(self, a: int, b: int) -> int:
            """Add, once.

            Args:
                a: The first.
                b: The second.
            """
            self.done = True
            return a + b

    ep = episode(tok, "qwen2", Once)
    assert ep.on_turn(turn(tok, "qwen2", CALL["qwen2"]), "stop") is None and ep.stats.tool_calls == 1

    class Bad:
        def step(self, messages):
            raise KeyError("state")

    ep = episode(tok, "qwen2", Bad)
    assert ep.on_turn(turn(tok, "qwen2", "hi"), "stop") is None and "KeyError: 'state'" in ep.stats.error


def test_reset_gives_the_first_observation(toks):
    tok = toks["qwen2"]

    class Game:
        def reset(self, row):
            return f"Guess a number below {row['n']}."

    ep = episode(tok, "qwen2", Game, row={"n": 10})
    assert ep.prompt_messages == [{"role": "user", "content": "Guess a number below 10."}]
    assert tok.decode(ep.start_ids, skip_special_tokens=False).endswith(
        "<|im_start|>user\nGuess a number below 10.<|im_end|>\n<|im_start|>assistant\n")
