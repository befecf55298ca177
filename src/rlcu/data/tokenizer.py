"""Tokenizer: the `tokenizers` library (the Rust tokenizer every HF checkpoint ships as
tokenizer.json) plus the chat-template renderer of `rlcu.data.chat_template`, with no
transformers at run time.

Loading follows transformers: chat_template.jinja (and chat_templates/<name>.jinja) win over
the template in tokenizer_config.json, named and extra special tokens missing from tokenizer.json
are added as special tokens, `split_special_tokens` and `clean_up_tokenization_spaces` are honoured,
and a named tokenizer class is rebuilt as transformers 5 rebuilds it (`rlcu.data.tokenizer_classes`:
Mistral's and Llama 2's files would otherwise encode differently after every control token).
`apply_chat_template` passes each named special token as a template variable (bos_token,
eos_token, ..., plus any other `*_token` of the config), then the caller's kwargs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from rlcu.data.chat_template import (  # noqa: F401
    UNSUPPORTED_OPTIONS,
    ChatTemplateError,
    render_chat,
    select_template,
)
from rlcu.data.tokenizer_classes import as_transformers_builds

_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


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
    """`backend` is a `tokenizers.Tokenizer`; `config` is the content of tokenizer_config.json;
    `model_type` is config.json's (None: no config.json), which with the config decides the class
    transformers would load and so how the backend is rebuilt (`hf_class`, rlcu.data.tokenizer_classes).
    `chat_template` is a string, a dict name -> template (one of them "default", or "tool_use"
    picked when tools are given), or None."""

    def __init__(self, backend: _Backend, config: Mapping | None = None, model_type: str | None = None):
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
        self.hf_class = as_transformers_builds(backend, cfg, model_type)
        backend.encode_special_tokens = bool(cfg.get("split_special_tokens", False))
        # transformers skips this WordPiece-era cleanup for BPE models, where it corrupts text
        self._clean_up = bool(cfg.get("clean_up_tokenization_spaces")) and not isinstance(backend.model, models.BPE)

    # --- files

    @classmethod
    def from_pretrained(cls, folder: str | Path, revision: str | None = None) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json (optional) and chat_template.jinja /
        chat_templates/*.jinja (optional; they win over the config's template). `folder` may also
        be the path of a tokenizer .json file; the other files are then looked for beside it; or a
        Hugging Face Hub id (at `revision`, or 'ID@revision'), whose tokenizer files are fetched."""
        from rlcu.hub import TOKENIZER_FILES, hub_id, model_folder

        name, folder = folder, Path(folder)
        if not folder.exists() and hub_id(name) is not None:
            folder = model_folder(name, revision, files=TOKENIZER_FILES)
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
        model = _read_json(folder / "config.json") if (folder / "config.json").is_file() else None
        model_type = model.get("model_type") if isinstance(model, dict) else None
        return cls(backend, config, model_type)

    def save_pretrained(self, folder: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (chat template inside, the form every
        transformers version reads). Template files that would override it on load are removed."""
        from rlcu.files import atomic_write

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / "tokenizer.json", lambda p: self.backend.save(str(p)))
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
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        atomic_write(folder / "tokenizer_config.json", lambda p: p.write_text(text, encoding="utf-8"))
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

    def encode_with_offsets(self, text: str, add_special_tokens: bool = False) -> tuple[list[int], list[tuple]]:
        """(ids, the (start, end) character span of `text` each token came from; (0, 0) for a token the
        post-processor added)."""
        enc = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return enc.ids, enc.offsets

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
        return select_template(self.chat_template, chat_template, tools)

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = False,
                            tools: list[dict] | None = None, *, documents: list[dict] | None = None,
                            chat_template: str | None = None, **kwargs) -> str | list[int] | list:
        """Render `messages` (a list of {"role", "content", ...} dicts, or a list of such lists for a
        batch) with the chat template; extra kwargs (e.g. enable_thinking=False) are template
        variables. Returns the text, or its ids (no special tokens added) when tokenize=True."""
        refused = [k for k in UNSUPPORTED_OPTIONS if k in kwargs]
        if refused:
            raise TypeError(f"apply_chat_template: {', '.join(refused)} not supported by rlcu's tokenizer")
        text = render_chat(self.chat_template, messages, add_generation_prompt, tools, documents=documents,
                           chat_template=chat_template, variables={**self.special_tokens, **kwargs})
        if not tokenize:
            return text
        return [self.encode(t) for t in text] if isinstance(text, list) else self.encode(text)


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
