"""Tool calls in a completion's text, per family format, and running one under a time limit.

    qwen3, qwen3_moe, qwen2   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, several a message
    llama          {"name": ..., "parameters": {...}} as the whole message, maybe after <|python_tag|>
    mistral        [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]

The model writes these, so anything may be wrong in them: a malformed call (bad JSON, no name, an
unknown tool, arguments that do not match the tool's schema) becomes a `ToolCallError` in the list,
with a message the model can read in the tool turn, never an exception that would stop a trainer
over one sample. A tool's own exception or a timeout in `call_tool` is turned into one too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlcu.timed import CallTimeout, call_with_timeout
from rlcu.tools.schema import as_tool

FAMILIES = ("qwen3", "qwen3_moe", "qwen2", "llama", "mistral")
_QWEN_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_TAG = "[TOOL_CALLS]"
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list,), "object": (dict,), "null": (type(None),)}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    raw: str  # the call's text as the model wrote it


@dataclass(frozen=True)
class ToolCallError:
    """A call that cannot run, or a tool that failed; `message` is what the model is shown."""
    message: str
    raw: str = ""
    name: str | None = None


@dataclass
class ParsedCalls:
    content: str  # the text around the calls
    calls: list[ToolCall | ToolCallError] = field(default_factory=list)


# ----------------------------------------------------------------------------- checking a call

def _type_error(value: Any, schema: Mapping, path: str) -> str | None:
    """Why `value` does not match `schema` (the JSON-schema subset rlcu.tools.schema writes), or None."""
    if value is None and schema.get("nullable"):
        return None
    if "anyOf" in schema:
        if all(_type_error(value, s, path) for s in schema["anyOf"]):
            return f"{path} matches none of its allowed types"
        return None
    if "enum" in schema and value not in schema["enum"]:
        return f"{path} must be one of {json.dumps(schema['enum'])}, got {json.dumps(value)}"
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else (kinds or [])
    ok = [k for k in kinds if isinstance(value, _JSON_TYPES.get(k, object))
          and not (isinstance(value, bool) and k in ("integer", "number"))]
    if kinds and not ok:
        return f"{path} must be {' or '.join(kinds)}, got {json.dumps(value)}"
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return next((e for i, v in enumerate(value) if (e := _type_error(v, schema["items"], f"{path}[{i}]"))),
                    None)
    if isinstance(value, dict) and "properties" in schema:
        return _arguments_error(value, schema, path)
    return None


def _arguments_error(args: dict, schema: Mapping, path: str = "argument") -> str | None:
    props = schema.get("properties") or {}
    missing = [r for r in schema.get("required", []) if r not in args]
    if missing:
        return f"missing required {path} {', '.join(repr(m) for m in missing)}"
    for k, v in args.items():
        if k not in props:
            if props:
                return f"unknown {path} {k!r}; the parameters are {', '.join(props)}"
            continue
        if err := _type_error(v, props[k], f"{path} {k!r}"):
            return err
    return None


def _schemas(tools) -> dict[str, Mapping] | None:
    if tools is None:
        return None
    out = {}
    for t in tools:
        f = as_tool(t)
        f = f.get("function", f)
        out[f["name"]] = f.get("parameters") or {}
    return out


def _call(obj: Any, raw: str, args_key: str, schemas: dict | None) -> ToolCall | ToolCallError:
    """One decoded call object checked: a name, a dict of arguments, a known tool, matching types."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCallError(f'a tool call must be a JSON object with a "name" and "{args_key}"', raw)
    name, args = obj["name"], obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            pass
    if not isinstance(args, dict):
        return ToolCallError(f'the "{args_key}" of a call to {name} must be a JSON object', raw, name)
    if schemas is not None:
        if name not in schemas:
            return ToolCallError(f"unknown tool {name!r}; the tools are {', '.join(schemas) or 'none'}", raw, name)
        if err := _arguments_error(args, schemas[name]):
            return ToolCallError(f"bad call to {name}: {err}", raw, name)
    return ToolCall(name, args, raw)


def _decode(text: str, args_key: str, schemas) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(text)
    except ValueError as e:
        return ToolCallError(f"a tool call is not valid JSON ({e})", text)
    return _call(obj, text, args_key, schemas)


# ----------------------------------------------------------------------------- the formats

def _qwen(text: str, schemas) -> ParsedCalls:
    calls = [_decode(m.group(1).strip(), "arguments", schemas) for m in _QWEN_CALL.finditer(text)]
    return ParsedCalls(_QWEN_CALL.sub("", text).strip(), calls)


def _llama(text: str, schemas) -> ParsedCalls:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    body = body.removeprefix(_PYTHON_TAG).strip()
    if not tagged and not body.startswith("{"):
        return ParsedCalls(text.strip())
    return ParsedCalls("", [_decode(body, "parameters", schemas)])


def _mistral(text: str, schemas) -> ParsedCalls:
    before, tag, after = text.partition(_MISTRAL_TAG)
    if not tag:
        return ParsedCalls(text.strip())
    after = after.strip()
    try:
        objs, end = json.JSONDecoder().raw_decode(after)
    except ValueError as e:
        return ParsedCalls(before.strip(), [ToolCallError(f"the tool calls are not valid JSON ({e})", after)])
    if isinstance(objs, dict):
        objs = [objs]
    if not isinstance(objs, list):
        return ParsedCalls(before.strip(), [ToolCallError("[TOOL_CALLS] must be followed by a JSON list", after)])
    content = (before.strip() + " " + after[end:].strip()).strip()
    return ParsedCalls(content, [_call(o, json.dumps(o, ensure_ascii=False), "arguments", schemas) for o in objs])


_PARSERS = {"qwen3": _qwen, "qwen3_moe": _qwen, "qwen2": _qwen, "llama": _llama, "mistral": _mistral}


def parse_tool_calls(text: str, family: str, tools: list | None = None) -> ParsedCalls:
    """The calls in one assistant message of `family` (model/family.py's names) and the text around
    them; with `tools` (schema dicts or functions) each call is checked against its tool's schema."""
    if family not in _PARSERS:
        raise ValueError(f"tool calls: unknown family {family!r}; one of {', '.join(FAMILIES)}")
    return _PARSERS[family](text, _schemas(tools))


# ----------------------------------------------------------------------------- running a call


def call_tool(fn: Callable, call: ToolCall | ToolCallError, timeout_s: float = 10.0) -> str | ToolCallError:
    """Run `fn(**call.arguments)` in a thread of its own (rlcu.timed); its result as text (a str as
    it is, anything else as JSON), or a ToolCallError for a malformed call, an exception or a run
    past `timeout_s`. A tool past its time is abandoned (a thread cannot be killed), so a tool that
    may hang for good belongs in a subprocess sandbox."""
    if isinstance(call, ToolCallError):
        return call
    try:
        out = call_with_timeout(lambda: fn(**call.arguments), timeout_s, f"tool:{call.name}")
    except CallTimeout:
        return ToolCallError(f"tool {call.name} timed out after {timeout_s:g} s", call.raw, call.name)
    except Exception as e:
        return ToolCallError(f"tool {call.name} failed: {type(e).__name__}: {e}", call.raw, call.name)
    if isinstance(out, str):
        return out
    try:
        return json.dumps(out, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(out)
