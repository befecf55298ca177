"""Preference pairs in TRL's format, for reward models and DPO: rows read as the prompt and SFT
sets are (data/datasets.py: JSONL / JSON / parquet, a dataset folder or a Hub id, errors naming
the file and line), validated, and tokenised to `PreferencePair(prompt_ids, chosen_ids,
rejected_ids, margin)`; the full sequences are prompt_ids + chosen_ids and prompt_ids +
rejected_ids.

A row holds `chosen` and `rejected`, each a string or chat messages, and optionally `prompt`
(explicit) and `margin` (a number; 0 when absent). Without a prompt (implicit), the prompt is
what the two share: the common messages before they differ, or for text the common tokens.
Pre-tokenised rows give `prompt_token_ids` (optional), `chosen_token_ids`, `rejected_token_ids`.

Text completions are encoded after the prompt's tokens and end with the tokenizer's EOS
(appended where missing, as TRL does, so that a reward model reads its score at the EOS).
Conversations are rendered by the family's chat template: each side's whole conversation once
(the ids the template's tokenisation gives), the prompt being the tokens the two renderings
share with the prompt's own rendering with the generation prompt.
"""

from __future__ import annotations

import dataclasses
import numbers

from rlcu.data.datasets import _check_messages, _read

ROW_FORMS = ("chosen + rejected (strings or chat messages), with an optional prompt and margin; "
             "or chosen_token_ids + rejected_token_ids (optional prompt_token_ids)")


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    margin: float = 0.0

    @property
    def chosen(self) -> list[int]:
        """The whole chosen sequence: prompt + chosen completion."""
        return self.prompt_ids + self.chosen_ids

    @property
    def rejected(self) -> list[int]:
        return self.prompt_ids + self.rejected_ids


# ---------------------------------------------------------------- reading and checking rows
def _is_ids(v) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def check_preference_row(row: dict, where: str) -> None:
    """A ValueError('where: ...') naming the field of a row that is not a preference pair."""
    if "margin" in row and row["margin"] is not None and (
            not isinstance(row["margin"], numbers.Real) or isinstance(row["margin"], bool)):
        raise ValueError(f"{where}: field 'margin' must be a number, got {row['margin']!r}")
    if "chosen_token_ids" in row or "rejected_token_ids" in row:
        for k in ("prompt_token_ids", "chosen_token_ids", "rejected_token_ids"):
            if (k in row or k != "prompt_token_ids") and not _is_ids(row.get(k)):
                raise ValueError(f"{where}: field {k!r} must be a list of token ids")
        if not row["chosen_token_ids"] or not row["rejected_token_ids"]:
            raise ValueError(f"{where}: chosen_token_ids and rejected_token_ids must not be empty")
        return
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(map(repr, missing))}; a preference row is "
                         f"{ROW_FORMS} (fields: {', '.join(row) or 'none'})")
    for k in ("prompt", "chosen", "rejected"):
        if k not in row:
            continue
        v = row[k]
        if isinstance(v, list):
            _check_messages(v, where, k)
        elif not isinstance(v, str):
            raise ValueError(f"{where}: field {k!r} must be a string or a list of chat messages, "
                             f"got {type(v).__name__}")
    if isinstance(row["chosen"], str) != isinstance(row["rejected"], str):
        raise ValueError(f"{where}: 'chosen' and 'rejected' must both be strings or both chat messages")


def load_preference_items(path, **source) -> list[tuple[str, dict]]:
    """[(location 'file:line' or 'file:row N', row)] of the preference rows of a data file,
    dataset folder or Hub dataset (source: split, subset, field), each checked."""
    items = _read(path, **source)
    for where, row in items:
        check_preference_row(row, where)
    return items


def load_preference_pairs(path, tokenizer, template_kwargs: dict | None = None, **source
                          ) -> list[tuple[str, PreferencePair]]:
    """Every row tokenised: [(location, PreferencePair)]; an error names the row's location."""
    out = []
    for where, row in load_preference_items(path, **source):
        try:
            out.append((where, encode_preference_row(row, tokenizer, **(template_kwargs or {}))))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return out


# ---------------------------------------------------------------- tokenising
def _common(*seqs) -> int:
    """The length of the longest common prefix of `seqs`."""
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs[1:]):
            return i
    return n


def _with_eos(ids: list[int], tokenizer) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def _split(prompt: list[int] | None, c: list[int], r: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) from the two whole sequences and the prompt's own ids (None: the
    shared prefix): the prompt is what all of them share; each completion what follows."""
    k = _common(c, r) if prompt is None else _common(prompt, c, r)
    if k == len(c) or k == len(r):
        raise ValueError("chosen and rejected are the same after the prompt (or one is the other's prefix); "
                         "a preference pair needs two different completions")
    return c[:k], c[k:], r[k:]


def encode_preference_row(row: dict, tokenizer, **template_kwargs) -> PreferencePair:
    """One checked row (check_preference_row) -> PreferencePair (see the module docstring)."""
    margin = float(row.get("margin") or 0.0)
    if "chosen_token_ids" in row:
        p = list(row.get("prompt_token_ids") or [])
        return PreferencePair(p, list(row["chosen_token_ids"]), list(row["rejected_token_ids"]), margin)
    if tokenizer is None:
        raise ValueError("text preference rows need a tokenizer (or give chosen_token_ids + rejected_token_ids)")
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    if isinstance(chosen, str) and not isinstance(prompt, list):
        if prompt is None:  # implicit: the tokens the two whole texts share
            p, c, r = _split(None, list(tokenizer.encode(chosen)), list(tokenizer.encode(rejected)))
            return PreferencePair(p, _with_eos(c, tokenizer), _with_eos(r, tokenizer), margin)
        p = list(tokenizer.encode(prompt))
        c, r = (_with_eos(list(tokenizer.encode(x)), tokenizer) for x in (chosen, rejected))
        if c == r:
            raise ValueError("chosen and rejected are the same completion")
        return PreferencePair(p, c, r, margin)
    return _encode_chat(prompt, chosen, rejected, tokenizer, margin, template_kwargs)


def _encode_chat(prompt, chosen, rejected, tokenizer, margin: float, kw: dict) -> PreferencePair:
    """A conversational pair: a text prompt becomes a user turn, a text completion an assistant
    turn; without a prompt, the messages both sides share are the prompt."""
    if isinstance(chosen, str):
        chosen, rejected = ([{"role": "assistant", "content": x}] for x in (chosen, rejected))
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if prompt is None:
        k = _common(chosen, rejected)
        prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
        if not chosen or not rejected:
            raise ValueError("chosen and rejected hold the same messages (or one the other's start); "
                             "a preference pair needs two different completions")

    def render(msgs, gen: bool) -> list[int]:
        return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True, **kw))

    p = render(prompt, True) if prompt else []
    return PreferencePair(*_split(p, render(prompt + chosen, False), render(prompt + rejected, False)), margin)
