"""Chat templates: a jinja2 renderer that makes what transformers' `apply_chat_template` makes,
token for token (a policy trained on prompts rendered differently from inference is trained on
inputs it never sees). It repeats `PreTrainedTokenizerBase.apply_chat_template`:

- a sandboxed environment (templates from the Hub are untrusted code) whose lists and dicts are
  immutable, with trim_blocks and lstrip_blocks on, the loopcontrols extension ({% break %},
  {% continue %}) and a pass-through {% generation %} tag (TRL-style assistant-mask templates);
- globals `raise_exception(msg)` and `strftime_now(fmt)`, and a `tojson` filter that is plain
  json.dumps with ensure_ascii=False (jinja's own filter escapes <, >, &, ' for HTML, which would
  change the bytes of every tool schema);
- variables: messages, tools, documents, add_generation_prompt, then the caller's `variables`
  (the tokenizer passes each named special token as a string, bos_token, eos_token, ..., then
  its kwargs, e.g. enable_thinking, which win over the tokens);
- messages are cleaned first: keys whose value is None are dropped (templates test for missing
  keys, not for None), values become plain JSON data, and reasoning given under any of
  reasoning_content / thinking / reasoning is offered as both `reasoning_content` (what Qwen3
  reads) and `thinking`;
- a tokenizer may carry several templates (a dict name -> template): "default", or "tool_use"
  when tools are given, unless the caller names one (`select_template`);
- tools are JSON-schema dicts or Python functions, which become the schema transformers'
  `get_json_schema` makes (rlcu.tools.schema).

Errors are `ChatTemplateError`s naming the template line.
"""

from __future__ import annotations

import dataclasses
import json
import traceback
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rlcu.tools.schema import as_tool

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# transformers' apply_chat_template options that rlcu does not implement; refused rather than
# silently passed to the template as variables.
UNSUPPORTED_OPTIONS = ("continue_final_message", "return_assistant_tokens_mask", "return_dict", "return_tensors",
                       "padding", "truncation", "max_length", "tokenizer_kwargs", "sanitize_control_tokens")


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render; the message names the template line."""


# ----------------------------------------------------------------------------- the environment

class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} marks assistant text in training templates; we render
    the body unchanged (assistant masks are not computed here)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _template_line(exc: BaseException) -> int | None:
    """The template line an exception came from: jinja rewrites tracebacks so that template code
    shows up as frames of the file "<template>"."""
    if getattr(exc, "lineno", None):
        return exc.lineno
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename == "<template>":
            line = frame.lineno
    return line


def _template_error(exc: BaseException, when: str) -> ChatTemplateError:
    line = _template_line(exc)
    where = f" (template line {line})" if line else ""
    if type(exc) is jinja2.exceptions.TemplateError:  # raise_exception() inside the template
        return ChatTemplateError(f"chat template raised an exception{where}: {exc}")
    return ChatTemplateError(f"chat template failed to {when}{where}: {type(exc).__name__}: {exc}")


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise _template_error(e, "compile") from e


def _plain(value: Any) -> Any:
    """JSON-like data only (rich objects would give the sandbox methods it does not know about);
    anything else becomes a placeholder naming its type, as transformers does."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic messages (OpenAI SDK)
        return _plain(value.model_dump())
    if isinstance(value, np.generic):  # np.bool_(False) must stay falsy
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _clean_messages(messages) -> list[dict]:
    out = []
    for m in messages:
        m = _plain(m)
        if not isinstance(m, dict):
            raise TypeError(f"chat messages must be dicts with 'role' and 'content', got {m!r}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_KEYS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _is_batch(messages) -> bool:
    return isinstance(messages, (list, tuple)) and len(messages) > 0 and isinstance(messages[0], (list, tuple))



# ----------------------------------------------------------------------------- selection and rendering

def select_template(templates: str | dict[str, str] | None, chat_template: str | None = None,
                    tools: list | None = None) -> str:
    """The template source. `templates` is a tokenizer's own (a string, a dict name -> template,
    or None); `chat_template` may name one of several templates or be a template."""
    own = templates
    if isinstance(own, dict):
        if chat_template is not None:
            return own.get(chat_template, chat_template)
        if tools is not None and "tool_use" in own:
            return own["tool_use"]
        if "default" in own:
            return own["default"]
        raise ValueError(f"this tokenizer has several chat templates and none named 'default'; "
                         f"pass chat_template= one of {sorted(own)}")
    if chat_template is not None:
        return chat_template
    if own is None:
        raise ValueError("this tokenizer has no chat template (no chat_template in tokenizer_config.json, "
                         "no chat_template.jinja); pass chat_template=")
    return own


def render_chat(templates: str | dict[str, str] | None, messages, add_generation_prompt: bool = False,
                tools: list | None = None, *, documents: list[dict] | None = None,
                chat_template: str | None = None, variables: Mapping | None = None) -> str | list[str]:
    """Render `messages` (a list of {"role", "content", ...} dicts, or a list of such lists for a
    batch, which gives a list of texts) with the template `select_template` picks; `variables`
    are further template variables."""
    if _is_batch(messages):
        return [render_chat(templates, m, add_generation_prompt, tools, documents=documents,
                            chat_template=chat_template, variables=variables) for m in messages]
    if len(messages) == 0:
        raise ValueError("cannot apply a chat template to an empty conversation")
    tools = None if tools is None else [as_tool(t) for t in tools]
    for d in documents or []:
        if not isinstance(d, Mapping):
            raise TypeError(f"documents must be dicts with 'title' and 'text', got {type(d).__name__}")
    template = _compile(select_template(templates, chat_template, tools))
    variables = _plain(dict(variables or {}))
    try:
        return template.render(messages=_clean_messages(messages), tools=_plain(tools),
                               documents=_plain(documents), add_generation_prompt=add_generation_prompt,
                               **variables)
    except Exception as e:
        raise _template_error(e, "render") from e
