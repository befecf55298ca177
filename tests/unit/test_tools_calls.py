"""rlcu.tools.calls: tool calls parsed from Qwen3/Qwen2.5, Llama 3.x and Mistral v0.3 text (several
calls, the text around them, malformed calls as ToolCallError values), checked against the tools'
schemas; a call rendered by the family's template (tests/support/chat_family_templates.py) parses
back to its name and arguments; call_tool's results, errors and time limit."""

import json
import threading
import time

import pytest
from support import chat_family_templates as tpl

from rlcu.data.chat_template import render_chat
from rlcu.tools.calls import ToolCall, ToolCallError, call_tool, parse_tool_calls


def add(a: int, b: float = 0.0) -> float:
    """Add two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def lookup(city: str, units: list[str], mode: str | None = None) -> dict:
    """Look a city up.

    Args:
        city: The city.
        units: Units to report in.
        mode: A mode (choices: ["fast", "full"])
    """
    return {"city": city, "units": units}


TOOLS = [add, lookup]


def _calls(parsed):
    return [(c.name, c.arguments) for c in parsed.calls]


def test_qwen_several_calls_and_text_around():
    text = ('<think>\nI need two tools.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "add", "arguments": '
            '{"a": 1, "b": 2.5}}\n</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {"city": "Zürich", '
            '"units": ["C"]}}\n</tool_call>')
    for family in ("qwen3", "qwen3_moe", "qwen2"):  # Qwen3-MoE's checkpoints share Qwen3's chat format
        p = parse_tool_calls(text, family, TOOLS)
        assert _calls(p) == [("add", {"a": 1, "b": 2.5}), ("lookup", {"city": "Zürich", "units": ["C"]})]
        assert p.content == "<think>\nI need two tools.\n</think>\n\nLet me check."
        assert p.calls[0].raw == '{"name": "add", "arguments": {"a": 1, "b": 2.5}}'
    assert parse_tool_calls("No tools needed: 42.", "qwen3").calls == []
    assert parse_tool_calls("No tools needed: 42.", "qwen3").content == "No tools needed: 42."


def test_llama_whole_message_with_or_without_python_tag():
    for text in ('{"name": "add", "parameters": {"a": 3}}', '<|python_tag|>{"name": "add", "parameters": {"a": 3}}'):
        p = parse_tool_calls(text, "llama", TOOLS)
        assert _calls(p) == [("add", {"a": 3})] and p.content == ""
    p = parse_tool_calls("The answer is {3}.", "llama", TOOLS)
    assert p.calls == [] and p.content == "The answer is {3}."


def test_mistral_list_of_calls():
    text = 'Sure. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}, "id": "abcdefghi"}, ' \
           '{"name": "lookup", "arguments": {"city": "Oslo", "units": []}}]'
    p = parse_tool_calls(text, "mistral", TOOLS)
    assert _calls(p) == [("add", {"a": 1}), ("lookup", {"city": "Oslo", "units": []})]
    assert p.content == "Sure."
    assert parse_tool_calls("plain", "mistral").calls == []


@pytest.mark.parametrize("family, text, words", [
    ("qwen3", '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>', ["not valid JSON"]),
    ("qwen3", '<tool_call>\n{"name": "add", "arguments": {"a": 1}', ["not valid JSON"]),  # cut off
    ("qwen3", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', ['"name"']),
    ("qwen2", '<tool_call>\n{"name": "mul", "arguments": {"a": 1}}\n</tool_call>', ["unknown tool 'mul'", "add"]),
    ("qwen3", '<tool_call>\n{"name": "add", "arguments": {"a": "one"}}\n</tool_call>',
     ["add", "'a'", "integer", '"one"']),
    ("qwen3", '<tool_call>\n{"name": "add", "arguments": {"a": true}}\n</tool_call>', ["'a'", "integer"]),
    ("qwen3", '<tool_call>\n{"name": "add", "arguments": {"b": 1}}\n</tool_call>', ["missing", "'a'"]),
    ("qwen3", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "c": 2}}\n</tool_call>', ["unknown", "'c'"]),
    ("qwen3", '<tool_call>\n{"name": "add", "arguments": [1]}\n</tool_call>', ["JSON object"]),
    ("qwen3", '<tool_call>\n{"name": "lookup", "arguments": {"city": "x", "units": [1]}}\n</tool_call>',
     ["units'[0]", "string"]),
    ("qwen3", '<tool_call>\n{"name": "lookup", "arguments": {"city": "x", "units": [], "mode": "slow"}}'
     '\n</tool_call>', ["mode", "fast"]),
    ("llama", '<|python_tag|>{"name": "add", "parameters": {"a": 1}', ["not valid JSON"]),
    ("llama", '{"name": "add", "parameters": {"a": 1.5}}', ["'a'", "integer"]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}', ["not valid JSON"]),
    ("mistral", '[TOOL_CALLS] "add"', ["JSON list"]),
])
def test_malformed_calls_are_values(family, text, words):
    p = parse_tool_calls(text, family, TOOLS)
    assert len(p.calls) == 1 and isinstance(p.calls[0], ToolCallError)
    assert all(w in p.calls[0].message for w in words), p.calls[0].message


def test_nullable_and_number_accept_what_they_should():
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><tool_call>\n' \
           '{"name": "lookup", "arguments": {"city": "x", "units": [], "mode": null}}\n</tool_call>'
    assert all(isinstance(c, ToolCall) for c in parse_tool_calls(text, "qwen3", TOOLS).calls)
    # without tools nothing is checked but the shape
    assert _calls(parse_tool_calls('<tool_call>{"name": "mul", "arguments": {"x": 1}}</tool_call>', "qwen3")) \
        == [("mul", {"x": 1})]


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="'gpt'.*qwen3, qwen3_moe, qwen2, llama, mistral"):
        parse_tool_calls("", "gpt")


# template name, family, end of the assistant turn, calls in one message
ROUND_TRIP = [("QWEN25", "qwen3", "<|im_end|>", 2), ("QWEN25", "qwen2", "<|im_end|>", 2),
              ("LLAMA31", "llama", "<|eot_id|>", 1), ("LLAMA32", "llama", "<|eot_id|>", 1),
              ("MISTRAL_V03", "mistral", "</s>", 2)]


@pytest.mark.parametrize("name, family, end, n", ROUND_TRIP, ids=lambda x: str(x))
def test_round_trip_through_the_template(name, family, end, n):
    calls = [{"id": "call12345", "type": "function", "function": {"name": "add", "arguments": {"a": 7, "b": 0.5}}},
             {"id": "call67890", "type": "function",
              "function": {"name": "lookup", "arguments": {"city": "Zürich \"old\" <town>", "units": ["C", "K"]}}}]
    chat = [{"role": "user", "content": "add 7 and a half"},
            {"role": "assistant", "content": "", "tool_calls": calls[:n]}]
    variables = {"bos_token": "<s>", "eos_token": "</s>"}
    template = getattr(tpl, name)
    prompt = render_chat(template, chat[:1], True, TOOLS, variables=variables)
    full = render_chat(template, chat, False, TOOLS, variables=variables)
    assert full.startswith(prompt)
    completion = full[len(prompt):].split(end)[0]
    parsed = parse_tool_calls(completion, family, TOOLS)
    assert _calls(parsed) == [(c["function"]["name"], c["function"]["arguments"]) for c in calls[:n]]
    assert parsed.content == ""


def test_call_tool_result_error_and_timeout():
    call = ToolCall("add", {"a": 2, "b": 0.5}, "")
    assert call_tool(add, call, 5) == "2.5"
    assert call_tool(lookup, ToolCall("lookup", {"city": "Köln", "units": []}, ""), 5) \
        == json.dumps({"city": "Köln", "units": []}, ensure_ascii=False)
    assert call_tool(lambda: "text", ToolCall("f", {}, ""), 5) == "text"
    bad = ToolCallError("not valid JSON")
    assert call_tool(add, bad, 5) is bad

    def boom(x: int):
        raise RuntimeError(f"no {x}")
    err = call_tool(boom, ToolCall("boom", {"x": 3}, ""), 5)
    assert isinstance(err, ToolCallError) and err.message == "tool boom failed: RuntimeError: no 3"
    err = call_tool(add, ToolCall("add", {"z": 1}, ""), 5)
    assert isinstance(err, ToolCallError) and "TypeError" in err.message

    release = threading.Event()
    t0 = time.monotonic()
    err = call_tool(lambda: release.wait(10), ToolCall("slow", {}, ""), 0.2)
    release.set()
    assert time.monotonic() - t0 < 5
    assert isinstance(err, ToolCallError) and err.message == "tool slow timed out after 0.2 s"


def test_tools_past_their_time_do_not_hold_up_later_calls():
    """Abandoned calls (a thread cannot be killed) hold no shared worker: after more hung tools than
    a pool would have workers, a quick tool still answers at once (a fixed pool of 8 timed it out)."""
    release = threading.Event()

    def hang() -> str:
        release.wait(30)
        return "late"

    try:
        for _ in range(10):
            out = call_tool(hang, ToolCall("hang", {}, ""), timeout_s=0.05)
            assert isinstance(out, ToolCallError) and "timed out" in out.message
        t0 = time.monotonic()
        assert call_tool(lambda: "ok", ToolCall("quick", {}, ""), timeout_s=1.0) == "ok"
        assert time.monotonic() - t0 < 0.5
    finally:
        release.set()
