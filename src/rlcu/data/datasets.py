"""Prompt and SFT data sets: JSONL / JSON / parquet rows, validated with file:line errors,
and their tokenisation. A source that is not a data file (a dataset folder, or a Hugging Face
Hub dataset id such as trl-lib/Capybara) is read by `datasets` (rlcu.hub), with its split and
subset; its rows are named 'NAME[split]:row N'.

A row is a dict; every field is kept (the reward functions see them). A prompt is a string
or chat messages ([{"role", "content"}, ...]). SFT rows are either prompt + completion
(strings, or chat messages for the prompt and a string or assistant messages for the
completion), chat `messages` whose assistant turns are the completion, or pre-tokenised
`prompt_token_ids` + `completion_token_ids`. Tokenised SFT examples are (ids, mask) with
mask[i] = 1 where token i is a completion token (trained on).
"""

from __future__ import annotations

import json
from pathlib import Path

from rlcu.hub import MissingPackage, dataset_rows, is_dataset_name


# ---------------------------------------------------------------- reading rows
def _decode(line: bytes, name, lineno: int) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = line[e.start:e.start + 4]
        raise ValueError(f"{name}:{lineno}: not valid UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1}, "
                         f"{bad!r}); re-encode the file as UTF-8") from None


def jsonl_rows(lines, name) -> list[tuple[int, dict]]:
    """(line number, row) of each non-blank line of JSONL text (an open file, text or binary,
    or any iterable of lines) read from `name`; a line that is not UTF-8 or not a JSON object
    raises ValueError('name:N: ...')."""
    out = []
    for lineno, line in enumerate(lines, 1):
        if isinstance(line, bytes):
            line = _decode(line, name, lineno)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}:{lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{name}:{lineno}: a row must be a JSON object, got {type(row).__name__}")
        out.append((lineno, row))
    return out


def _read(path, split: str = "train", subset: str | None = None, field: str | None = None
          ) -> list[tuple[str, dict]]:
    """[(location 'file:line' or 'file:row N', row)]. `split` and `subset` choose the rows of a
    dataset folder or Hub id; `field` (data.path, ...) is named in the errors about `path`."""
    if is_dataset_name(path):
        return dataset_rows(path, split, subset, field)
    where = f"{field}: {path}" if field else str(path)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{where}: no such data file; give a .jsonl, .json or .parquet file, a dataset "
                                "folder, or a Hugging Face Hub dataset id such as trl-lib/Capybara")
    suf = path.suffix.lower()
    out: list[tuple[str, dict]] = []
    if suf == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise MissingPackage(f"{path}: reading parquet needs pyarrow (pip install pyarrow), "
                              "or convert the file to JSONL") from None
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            out.append((f"{path}:row {i + 1}", row))
        return out
    if suf == ".json":
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            lineno = raw.count(b"\n", 0, e.start) + 1
            col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
            raise ValueError(f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {col}); "
                             "re-encode the file as UTF-8") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
        if isinstance(data, dict) and len(data) == 1 and isinstance(next(iter(data.values())), list):
            data = next(iter(data.values()))  # {"data": [...]}
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json data file must hold a list of rows")
        for i, row in enumerate(data):
            if not isinstance(row, dict):
                raise ValueError(f"{path}:row {i + 1}: a row must be a JSON object, got {type(row).__name__}")
            out.append((f"{path}:row {i + 1}", row))
        return out
    if suf not in (".jsonl", ".ndjson"):
        raise ValueError(f"{path}: unsupported data format {suf or '(no suffix)'!r}; use .jsonl, .json or .parquet")
    with open(path, "rb") as f:
        return [(f"{path}:{lineno}", row) for lineno, row in jsonl_rows(f, path)]


def _check_messages(msgs, where: str, field: str) -> None:
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: field {field!r} must be a non-empty list of chat messages")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ValueError(f"{where}: {field}[{j}] must be a {{'role': str, 'content': ...}} message, got {m!r}")


def _check_prompt(p, where: str, field: str) -> None:
    if isinstance(p, str):
        return
    if isinstance(p, list):
        _check_messages(p, where, field)
        return
    raise ValueError(f"{where}: field {field!r} must be a string or a list of chat messages, got {type(p).__name__}")


def load_rows(path, **source) -> list[dict]:
    """Every row of a .jsonl / .json / .parquet file, dataset folder or Hub dataset,
    unvalidated. `source`: split, subset, field (see _read)."""
    return [r for _, r in _read(path, **source)]


def load_prompts(path, prompt_field: str = "prompt", **source) -> list[dict]:
    """Rows with a prompt (string or chat messages) in `prompt_field`; other fields kept.
    A malformed line or a missing / ill-typed prompt raises ValueError('file:line: ...')."""
    return [r for _, r in load_prompt_items(path, prompt_field, **source)]


def load_prompt_items(path, prompt_field: str = "prompt", **source) -> list[tuple[str, dict]]:
    """load_prompts with each row's location: [('file:line' or 'file:row N', row)]."""
    items = []
    for where, row in _read(path, **source):
        if prompt_field not in row:
            raise ValueError(f"{where}: missing field {prompt_field!r} (fields: {', '.join(row) or 'none'})")
        _check_prompt(row[prompt_field], where, prompt_field)
        items.append((where, row))
    return items


def load_sft_rows(path, prompt_field: str = "prompt", completion_field: str = "completion",
                  messages_field: str = "messages", **source) -> list[dict]:
    """Rows usable for SFT (see the module docstring), with file:line errors."""
    rows = []
    for where, row in _read(path, **source):
        check_sft_row(row, where, prompt_field, completion_field, messages_field)
        rows.append(row)
    return rows


def load_sft_items(path, prompt_field: str = "prompt", completion_field: str = "completion",
                   messages_field: str = "messages", **source) -> list[tuple[str, dict]]:
    """load_sft_rows with each row's location: [('file:line' or 'file:row N', row)]."""
    items = []
    for where, row in _read(path, **source):
        check_sft_row(row, where, prompt_field, completion_field, messages_field)
        items.append((where, row))
    return items


def check_sft_row(row: dict, where: str, prompt_field="prompt", completion_field="completion",
                  messages_field="messages") -> None:
    if "prompt_token_ids" in row or "completion_token_ids" in row:
        for k in ("prompt_token_ids", "completion_token_ids"):
            v = row.get(k)
            if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                raise ValueError(f"{where}: field {k!r} must be a list of token ids")
        return
    if messages_field in row:
        _check_messages(row[messages_field], where, messages_field)
        if not any(m["role"] == "assistant" for m in row[messages_field]):
            raise ValueError(f"{where}: {messages_field!r} has no assistant turn to train on")
        return
    if prompt_field in row and completion_field in row:
        _check_prompt(row[prompt_field], where, prompt_field)
        c = row[completion_field]
        if isinstance(c, list):
            _check_messages(c, where, completion_field)
        elif not isinstance(c, str):
            raise ValueError(f"{where}: field {completion_field!r} must be a string or assistant messages")
        return
    raise ValueError(f"{where}: an SFT row needs {prompt_field!r} + {completion_field!r}, or {messages_field!r}, "
                     f"or prompt_token_ids + completion_token_ids (fields: {', '.join(row) or 'none'})")


# ---------------------------------------------------------------- tokenising
def encode_prompt(tokenizer, prompt, **template_kwargs) -> list[int]:
    """A prompt's token ids: a string is encoded as is; chat messages are rendered with the
    chat template and the generation prompt."""
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                              **template_kwargs))


def filter_long(rows: list[dict], tokenizer, max_tokens: int | None, prompt_field: str = "prompt"
                ) -> tuple[list[dict], int]:
    """Drop rows whose prompt is longer than `max_tokens` tokens -> (kept rows, number dropped)."""
    if max_tokens is None:
        return list(rows), 0
    kept = [r for r in rows if len(encode_prompt(tokenizer, r[prompt_field])) <= max_tokens]
    return kept, len(rows) - len(kept)


def _find(full: str, content: str, start: int) -> tuple[int, int]:
    """(start, end) of an assistant message's content in the rendered chat from `start`, or (-1, -1);
    templates that trim the content (Llama 3's, Mistral's) are found by the trimmed text."""
    for text in (content, content.strip()):
        s = full.find(text, start) if text else -1
        if s >= 0:
            return s, s + len(text)
    return -1, -1


def _chat_spans(tokenizer, msgs: list[dict], first: int, kw: dict) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation; return its text and the character spans of the assistant
    turns at index >= first (each from where the generation prompt ends to the end of the
    turn, end-of-turn token included). Where the rendering of the turns before is not a prefix
    of the whole (Mistral's system prompt goes with the last user message), the span is found
    by the message's content."""
    full = tokenizer.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False, **kw)
    eos = getattr(tokenizer, "eos_token", None)
    spans, cur = [], 0
    for i, m in enumerate(msgs):
        if m["role"] != "assistant" or i < first:
            continue
        content = m.get("content") or ""
        s = -1
        if i > 0:
            pre = tokenizer.apply_chat_template(msgs[:i], add_generation_prompt=True, tokenize=False, **kw)
            if full.startswith(pre) and len(pre) >= cur:
                s = len(pre)
        if s < 0:
            s = _find(full, content, cur)[0]
            if s < 0:
                raise ValueError(f"cannot find assistant turn {i} in the rendered chat template")
        upto = tokenizer.apply_chat_template(msgs[:i + 1], add_generation_prompt=False, tokenize=False, **kw)
        if full.startswith(upto) and len(upto) > s:
            e = len(upto)
        else:
            e = _find(full, content, s)[1]
            if e < 0:
                raise ValueError(f"cannot find the end of assistant turn {i} in the rendered chat template")
            if eos and full.startswith(eos, e):
                e += len(eos)
        spans.append((s, e))
        cur = e
    return full, spans


def _mask_by_offsets(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """The whole text encoded at once (the ids apply_chat_template(tokenize=True) gives), mask 1 on
    each token that overlaps a span (a token across a span's edge, Mistral's "▁Fine" after [/INST],
    is trained on)."""
    ids, offsets = tokenizer.encode_with_offsets(text)
    mask, k = [], 0
    for a, b in offsets:
        while k < len(spans) and a >= spans[k][1]:
            k += 1
        mask.append(int(k < len(spans) and b > spans[k][0] and b > a))
    return ids, mask


def encode_sft_row(row: dict, tokenizer, prompt_field="prompt", completion_field="completion",
                   messages_field="messages", **template_kwargs) -> tuple[list[int], list[int]]:
    """-> (ids, mask): mask 1 on the completion tokens. A plain-text completion gets the
    tokenizer's EOS appended (so the model learns to stop)."""
    if "prompt_token_ids" in row:
        p, c = list(row["prompt_token_ids"]), list(row["completion_token_ids"])
        return p + c, [0] * len(p) + [1] * len(c)
    if tokenizer is None:
        raise ValueError("text SFT rows need a tokenizer (or give prompt_token_ids + completion_token_ids)")
    if messages_field in row:
        msgs, first = row[messages_field], 0
    else:
        prompt, comp = row[prompt_field], row[completion_field]
        if isinstance(prompt, str) and isinstance(comp, str):
            p = list(tokenizer.encode(prompt))
            c = list(tokenizer.encode(comp))
            eos = getattr(tokenizer, "eos_token_id", None)
            if eos is not None and (not c or c[-1] != eos):
                c.append(eos)
            return p + c, [0] * len(p) + [1] * len(c)
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(comp, str):
            comp = [{"role": "assistant", "content": comp}]
        msgs, first = list(prompt) + list(comp), len(prompt)
    text, spans = _chat_spans(tokenizer, msgs, first, template_kwargs)
    if callable(getattr(tokenizer, "encode_with_offsets", None)):
        return _mask_by_offsets(tokenizer, text, spans)
    ids: list[int] = []  # a tokenizer without offsets: encoded piece by piece
    mask: list[int] = []
    cur = 0
    for s, e in spans:
        for chunk, flag in ((text[cur:s], 0), (text[s:e], 1)):
            if chunk:
                t = list(tokenizer.encode(chunk))
                ids += t
                mask += [flag] * len(t)
        cur = e
    if text[cur:]:
        t = list(tokenizer.encode(text[cur:]))
        ids += t
        mask += [0] * len(t)
    return ids, mask
