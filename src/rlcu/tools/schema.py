"""A tool's JSON schema from a plain Python function, the one transformers' `get_json_schema`
makes, so a template renders the same bytes whichever library built the schema:

    {"type": "function", "function": {"name", "description", "parameters": {"type": "object",
     "properties": {arg: {<type>, "description"}}, "required": [args without a default]},
     "return": {<type>, "description"}}}

Type hints map as JSON types: str, int, float, bool, None; list[X] (items), tuple[X, Y]
(prefixItems), dict[K, V] (additionalProperties), Literal and Enum (enum, with the values'
types), unions (a sorted type list when every member is a plain type, else anyOf; None in the
union adds nullable). The docstring is Google style: the text before `Args:` / `Returns:` /
`Raises:` is the description, each `Args:` entry (`name (type): text`, continued on deeper
lines) the parameter's, a trailing `(choices: [...])` in it an enum. A return hint that does not
map is left out (the model never writes the return value); a parameter's is an error.
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

_SECTIONS = ("Args:", "Returns:", "Raises:")
_ENTRY = re.compile(r"^(\s*)(\w+)(?:\s*\([^()\n]*\))?:\s*(.*)$")
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)
_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
_BARE = {list: {"type": "array"}, tuple: {"type": "array"}, dict: {"type": "object"}, Any: {}}


class ToolSchemaError(TypeError):
    """A function cannot be described as a tool; the message names the function and the parameter."""


# ----------------------------------------------------------------------------- docstrings

def _sections(doc: str) -> dict[str, list[str]]:
    """The docstring's lines by section: "" (the description), "Args:", "Returns:", "Raises:"."""
    out, name = {"": []}, ""
    for line in doc.split("\n"):
        if line.strip() in _SECTIONS:
            name = line.strip()
            out[name] = []
        else:
            out[name].append(line)
    return out


def _arg_docs(lines: list[str]) -> dict[str, str]:
    """`name (type): text` entries; a line indented deeper than its entry continues it."""
    lines = [x for x in lines if x.strip()]
    out, indent, name = {}, None, None
    for line in lines:
        m = _ENTRY.match(line)
        if m and (indent is None or len(m.group(1)) <= indent):
            indent, name = len(m.group(1)), m.group(2)
            out[name] = m.group(3).strip()
        elif name is not None:
            out[name] = (out[name] + " " + line.strip()).strip()
    return out


def parse_docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    """(description, {parameter: description}, returns description or None) of a Google-style docstring."""
    parts = _sections(inspect.cleandoc(doc))
    returns = "\n".join(parts["Returns:"]).strip() if "Returns:" in parts else None
    return "\n".join(parts[""]).strip(), _arg_docs(parts.get("Args:", [])), returns


# ----------------------------------------------------------------------------- type hints

def _enum(values: list) -> dict:
    kinds = list(dict.fromkeys(_SCALARS[type(v)] for v in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _union(args: tuple, where: str) -> dict:
    members = [type_schema(a, where) for a in args if a is not type(None)]
    if len(members) == 1:
        out = members[0]
    elif all(m.keys() == {"type"} and isinstance(m["type"], str) for m in members):
        kinds = sorted({m["type"] for m in members})
        out = {"type": kinds[0] if len(kinds) == 1 else kinds}
    else:
        out = {"anyOf": members}
    if type(None) in args:
        out["nullable"] = True
    return out


def type_schema(hint: Any, where: str = "a parameter") -> dict:
    """The JSON schema of one type hint; `where` names the function and parameter in errors."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            values = [m.value for m in hint]
            if not values or any(type(v) not in _SCALARS for v in values):
                raise ToolSchemaError(f"{where}: the Enum {hint.__name__} needs members whose values are "
                                      "str, int, float, bool or None")
            return _enum(values)
        if hint in _SCALARS:
            return {"type": _SCALARS[hint]}
        if hint in _BARE:
            return dict(_BARE[hint])
        raise ToolSchemaError(f"{where}: the type hint {hint!r} has no JSON schema (use str, int, float, bool, "
                              "list, tuple, dict, Literal, an Enum or a union of them)")
    if origin is typing.Union or origin is types.UnionType:
        return _union(args, where)
    if origin is typing.Literal:
        if not args or any(type(a) not in _SCALARS for a in args):
            raise ToolSchemaError(f"{where}: Literal takes str, int, float, bool or None values")
        return _enum(list(args))
    if origin is list:
        return {"type": "array", "items": type_schema(args[0], where)} if args else {"type": "array"}
    if origin is tuple:
        if len(args) == 1 or ... in args:
            raise ToolSchemaError(f"{where}: {hint} is not a fixed tuple of several items; use list[...]")
        return {"type": "array", "prefixItems": [type_schema(a, where) for a in args]}
    if origin is dict:
        return {"type": "object", "additionalProperties": type_schema(args[1], where)} if len(args) == 2 \
            else {"type": "object"}
    raise ToolSchemaError(f"{where}: the type hint {hint!r} has no JSON schema")


# ----------------------------------------------------------------------------- the function

def _parameters(fn: Callable, name: str) -> tuple[dict, list[str], dict | None]:
    """(properties, required, return schema or None); an unannotated first self/cls is the receiver."""
    sig, hints = inspect.signature(fn), typing.get_type_hints(fn)
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls") and params[0].annotation is inspect.Parameter.empty:
        params = params[1:]
    properties, required = {}, []
    for p in params:
        if p.annotation is inspect.Parameter.empty:
            raise ToolSchemaError(f"tool {name}: parameter {p.name!r} has no type hint")
        properties[p.name] = type_schema(hints[p.name], f"tool {name}, parameter {p.name!r}")
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    returns = None
    if "return" in hints:
        try:
            returns = type_schema(hints["return"], f"tool {name}, return")
        except ToolSchemaError:
            pass
    return properties, required, returns


def json_schema(fn: Callable) -> dict:
    """The tool schema of `fn` (see the module docstring); ToolSchemaError when a parameter lacks a
    type hint or a docstring entry, or the function has no docstring."""
    name = getattr(fn, "__name__", "operation")
    if not (inspect.getdoc(fn) or "").strip():
        raise ToolSchemaError(f"tool {name} has no docstring: its description and Args: entries are the schema's")
    description, arg_docs, returns_doc = parse_docstring(inspect.getdoc(fn))
    properties, required, returns = _parameters(fn, name)
    for arg, schema in properties.items():
        if arg not in arg_docs:
            raise ToolSchemaError(f"tool {name}: parameter {arg!r} has no entry in the docstring's Args: section")
        text = arg_docs[arg]
        if choices := _CHOICES.search(text):
            schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            text = text[: choices.start()].strip()
        schema["description"] = text
    parameters = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    out = {"name": name, "description": description, "parameters": parameters}
    if returns is not None:
        if returns_doc is not None:
            returns["description"] = returns_doc
        out["return"] = returns
    return {"type": "function", "function": out}


def as_tool(tool: Mapping | Callable) -> Mapping:
    """A tool as chat templates take it: a schema dict as it is, a function as its json_schema."""
    if isinstance(tool, Mapping):
        return tool
    if callable(tool):
        return json_schema(tool)
    raise ToolSchemaError(f"tools must be JSON-schema dicts or Python functions, got {type(tool).__name__}")
