"""Tokenizer and chat template: the `tokenizers` library (the Rust tokenizer every HF checkpoint
ships as tokenizer.json) plus a jinja2 chat-template renderer, with no transformers at run time.

Prompts must match what transformers makes token for token, or a policy is trained on inputs it
never sees at inference. So the renderer repeats `PreTrainedTokenizerBase.apply_chat_template`:

- a sandboxed environment (templates from the Hub are untrusted code) whose lists and dicts are
  immutable, with trim_blocks and lstrip_blocks on, the loopcontrols extension ({% break %},
  {% continue %}) and a pass-through {% generation %} tag (TRL-style assistant-mask templates);
- globals `raise_exception(msg)` and `strftime_now(fmt)`, and a `tojson` filter that is plain
  json.dumps with ensure_ascii=False (jinja's own filter escapes <, >, &, ' for HTML, which would
  change the bytes of every tool schema);
- variables: messages, tools, documents, add_generation_prompt, each named special token as a
  string (bos_token, eos_token, ..., plus any other `*_token` of the config), then the caller's
  kwargs (e.g. enable_thinking), which win over the tokens;
- messages are cleaned first: keys whose value is None are dropped (templates test for missing
  keys, not for None), values become plain JSON data, and reasoning given under any of
  reasoning_content / thinking / reasoning is offered as both `reasoning_content` (what Qwen3
  reads) and `thinking`.

Loading follows transformers too: chat_template.jinja (and chat_templates/<name>.jinja) win over
the template in tokenizer_config.json, named and extra special tokens missing from tokenizer.json
are added as special tokens, `split_special_tokens` and `clean_up_tokenization_spaces` are honoured.
"""

from __future__ import annotations

import dataclasses
import json
import traceback
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
import numpy as np
from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# transformers' apply_chat_template options that rlcu does not implement; refused rather than
# silently passed to the template as variables.
_UNSUPPORTED = ("continue_final_message", "return_assistant_tokens_mask", "return_dict", "return_tensors",
                "padding", "truncation", "max_length", "tokenizer_kwargs", "sanitize_control_tokens")


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render; the message names the template line."""


# ----------------------------------------------------------------------------- chat templates

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


# ----------------------------------------------------------------------------- files

def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or a serialised AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_token(entry: Mapping) -> AddedToken:
    return AddedToken(entry["content"], single_word=entry.get("single_word", False),
                      lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
                      normalized=entry.get("normalized", True), special=entry.get("special", False))


def _clean_up_spaces(text: str) -> str:
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


# ----------------------------------------------------------------------------- the tokenizer

class Tokenizer:
    """`backend` is a `tokenizers.Tokenizer`; `config` is the content of tokenizer_config.json.
    `chat_template` is a string, a dict name -> template (one of them "default", or "tool_use"
    picked when tools are given), or None."""

    def __init__(self, backend: _Backend, config: Mapping | None = None):
        self.backend = backend
        self.config = dict(config or {})
        template = self.config.pop("chat_template", None)
        if isinstance(template, (list, tuple)):
            template = {t["name"]: t["template"] for t in template}
        self.chat_template: str | dict[str, str] | None = template

        # Named special tokens, as transformers collects them: the standard names (a string or a
        # serialised AddedToken), any other `*_token` string, and a dict of extra_special_tokens.
        cfg = self.config
        named = {k: _token_content(cfg.get(k)) for k in _NAMED_TOKENS}
        named.update({k: v for k, v in cfg.items() if k.endswith("_token") and k not in named and isinstance(v, str)})
        extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or []
        if isinstance(extra, Mapping):
            named.update({k: _token_content(v) for k, v in extra.items()})
            extra = []
        self.special_tokens: dict[str, str] = {k: v for k, v in named.items() if v is not None}

        # Tokens the config knows but tokenizer.json does not are added, in transformers' order.
        have = {t.content for t in backend.get_added_tokens_decoder().values()}
        to_add = []
        for _, entry in sorted(((int(i), e) for i, e in (cfg.get("added_tokens_decoder") or {}).items())):
            if entry["content"] not in have:
                to_add.append(_added_token(entry))
                have.add(entry["content"])
        for tok in [*self.special_tokens.values(), *extra]:
            content = _token_content(tok)
            if content is not None and content not in have:
                to_add.append(AddedToken(content, special=True, normalized=False))
                have.add(content)
        for tok in to_add:
            (backend.add_special_tokens if tok.special else backend.add_tokens)([tok])
        backend.encode_special_tokens = bool(cfg.get("split_special_tokens", False))
        # transformers skips this WordPiece-era cleanup for BPE models, where it corrupts text
        self._clean_up = bool(cfg.get("clean_up_tokenization_spaces")) and not isinstance(backend.model, models.BPE)

    # --- files

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json (optional) and chat_template.jinja /
        chat_templates/*.jinja (optional; they win over the config's template). `folder` may also
        be the path of a tokenizer .json file; the other files are then looked for beside it."""
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        if folder.is_file() and folder.suffix == ".json":
            folder, tok_file = folder.parent, folder
        elif not folder.is_dir():
            raise FileNotFoundError(f"tokenizer folder {folder} does not exist")
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder} (rlcu reads fast-tokenizer files only)")
        try:
            backend = _Backend.from_file(str(tok_file))
        except Exception as e:  # the Rust side says little about where; json tells the line
            _read_json(tok_file)
            raise ValueError(f"{tok_file}: not a valid tokenizers file: {e}") from None
        cfg_file = folder / "tokenizer_config.json"
        config = _read_json(cfg_file) if cfg_file.is_file() else {}
        if not isinstance(config, dict):
            raise ValueError(f"{cfg_file}: expected a JSON object, got {type(config).__name__}")
        templates = {}
        if (folder / "chat_template.jinja").is_file():
            templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        if (folder / "chat_templates").is_dir():
            for f in sorted((folder / "chat_templates").glob("*.jinja")):
                templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
        if templates:
            config["chat_template"] = templates["default"] if list(templates) == ["default"] else templates
        return cls(backend, config)

    def save_pretrained(self, folder: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (chat template inside, the form every
        transformers version reads). Template files that would override it on load are removed."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.config}
        config.update({k: v for k, v in self.special_tokens.items() if k in config or k in _NAMED_TOKENS})
        config["added_tokens_decoder"] = {
            str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                     "single_word": t.single_word, "special": t.special}
            for i, t in sorted(self.backend.get_added_tokens_decoder().items())}
        if isinstance(self.chat_template, dict):
            config["chat_template"] = [{"name": k, "template": v} for k, v in self.chat_template.items()]
        elif self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                      encoding="utf-8")
        (folder / "chat_template.jinja").unlink(missing_ok=True)
        if (folder / "chat_templates").is_dir():
            for f in (folder / "chat_templates").glob("*.jinja"):
                f.unlink()

    # --- vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (transformers' len(tokenizer))."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(int(i))

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    # --- text <-> ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """`ids`: an int or a sequence of ints (list, tensor, array)."""
        ids = [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._clean_up else text

    def decode_batch(self, batch, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in batch]

    # --- chat

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template source: `chat_template` may name one of several templates or be a template."""
        own = self.chat_template
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

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = False,
                            tools: list[dict] | None = None, *, documents: list[dict] | None = None,
                            chat_template: str | None = None, **kwargs) -> str | list[int] | list:
        """Render `messages` (a list of {"role", "content", ...} dicts, or a list of such lists for a
        batch) with the chat template; extra kwargs (e.g. enable_thinking=False) are template
        variables. Returns the text, or its ids (no special tokens added) when tokenize=True."""
        refused = [k for k in _UNSUPPORTED if k in kwargs]
        if refused:
            raise TypeError(f"apply_chat_template: {', '.join(refused)} not supported by rlcu's tokenizer")
        if _is_batch(messages):
            return [self.apply_chat_template(m, add_generation_prompt, tokenize, tools, documents=documents,
                                             chat_template=chat_template, **kwargs) for m in messages]
        if len(messages) == 0:
            raise ValueError("cannot apply a chat template to an empty conversation")
        for t in tools or []:
            if not isinstance(t, Mapping):
                raise TypeError(f"tools must be JSON-schema dicts, got {type(t).__name__}")
        for d in documents or []:
            if not isinstance(d, Mapping):
                raise TypeError(f"documents must be dicts with 'title' and 'text', got {type(d).__name__}")
        template = _compile(self.get_chat_template(chat_template, tools))
        variables = _plain({**self.special_tokens, **kwargs})
        try:
            text = template.render(messages=_clean_messages(messages), tools=_plain(tools),
                                   documents=_plain(documents), add_generation_prompt=add_generation_prompt,
                                   **variables)
        except Exception as e:
            raise _template_error(e, "render") from e
        return self.encode(text) if tokenize else text


def make_word_tokenizer(words, special_tokens=(), chat_template: str | dict | None = None, *,
                        eos_token: str | None = None, pad_token: str | None = None,
                        unk_token: str = "<unk>") -> Tokenizer:
    """A word-level tokenizer for tests and demos: id 0 is `unk_token`, then `words` in order, then
    `special_tokens` (added, special). Text is split on whitespace and at word/punctuation
    boundaries, so each word must be a run of letters/digits/_ or a run of punctuation.
    eos defaults to <|im_end|> when present, else the first special token; pad to <|endoftext|>
    when present, else eos (Qwen3's conventions)."""
    split = pre_tokenizers.Whitespace()
    vocab: dict[str, int] = {unk_token: 0}
    for w in words:
        if [p for p, _ in split.pre_tokenize_str(w)] != [w]:
            raise ValueError(f"word {w!r} would be split by the whitespace pre-tokenizer; "
                             "use runs of letters/digits/_ or runs of punctuation")
        vocab.setdefault(w, len(vocab))
    specials = list(dict.fromkeys(special_tokens))
    if eos_token is None and specials:
        eos_token = "<|im_end|>" if "<|im_end|>" in specials else specials[0]
    if pad_token is None:
        pad_token = "<|endoftext|>" if "<|endoftext|>" in specials else eos_token
    for name, tok in (("eos_token", eos_token), ("pad_token", pad_token)):
        if tok is not None and tok not in specials:
            raise ValueError(f"{name} {tok!r} is not one of special_tokens {specials}")
    backend = _Backend(models.WordLevel(vocab, unk_token=unk_token))
    backend.pre_tokenizer = split
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": eos_token,
              "pad_token": pad_token, "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        config["chat_template"] = chat_template
    return Tokenizer(backend, config)
