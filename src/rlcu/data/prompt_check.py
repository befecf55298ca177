"""Every prompt checked against the model's context at load, before anything runs.

A prompt fits when its tokens plus max_new_tokens fit the model's context
(max_position_embeddings), and when it has at most data.max_prompt_tokens tokens where that
is set. One that does not is dropped and counted, with its row (file:line) in the log
(`data.overlong_prompts: drop`, the default), or stops the run before training with the
rows named (`error`). So no request is refused by the engine hours into a run, and the
engine's KV pool is sized from the longest prompt that is kept (a 10 MB line cannot make it
ask for hundreds of GB).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from rlcu.data.datasets import load_prompt_items

POLICIES = ("drop", "error")
_SHOW = 10  # rows named in a message


def shown_rows(rows: list[str]) -> str:
    """The first rows of a message's list (locations, with what is said of each), then how many more."""
    more = f" and {len(rows) - _SHOW} more" if len(rows) > _SHOW else ""
    return ", ".join(rows[:_SHOW]) + more


@dataclasses.dataclass
class PromptLimit:
    max_tokens: int  # the most prompt tokens allowed
    why: str  # what sets it, for messages
    policy: str = "drop"


def prompt_limit(context: int, max_new_tokens: int, max_prompt_tokens: int | None = None,
                 policy: str = "drop") -> PromptLimit:
    """The prompt-length limit of a run: context - max_new_tokens, and max_prompt_tokens."""
    if policy not in POLICIES:
        raise ValueError(f"data.overlong_prompts must be one of {', '.join(POLICIES)}, got {policy!r}")
    room = int(context) - int(max_new_tokens)
    if room < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's context "
                         f"(max_position_embeddings={context})")
    why = f"the model's context (max_position_embeddings={context}) less max_new_tokens={max_new_tokens}"
    if max_prompt_tokens is not None and max_prompt_tokens < room:
        return PromptLimit(int(max_prompt_tokens), f"data.max_prompt_tokens={max_prompt_tokens}", policy)
    return PromptLimit(room, why, policy)


@dataclasses.dataclass
class PromptReport:
    source: str
    total: int
    limit: PromptLimit
    dropped: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # (row, its tokens)
    longest: int = 0  # tokens of the longest prompt kept

    @property
    def n_dropped(self) -> int:
        return len(self.dropped)

    def rows_text(self) -> str:
        return shown_rows([f"{w} ({n} tokens)" for w, n in self.dropped])

    def message(self) -> str | None:
        """The log line for the dropped prompts (None: none dropped)."""
        if not self.dropped:
            return None
        return (f"{self.source}: dropped {self.n_dropped} of {self.total} prompts longer than "
                f"{self.limit.max_tokens} tokens ({self.limit.why}): {self.rows_text()}")


def check_prompts(items: list[tuple[str, dict]], prompt_len: Callable[[dict], int], limit: PromptLimit,
                  source: str) -> tuple[list[dict], PromptReport]:
    """Keep the rows whose prompt fits `limit` -> (kept rows, report). An empty data set, with
    policy 'error' any row over the limit, and with 'drop' a data set left empty, raise
    ValueError naming `source`."""
    if not items:
        raise ValueError(f"{source}: no rows (an empty data set); a prompt data set needs at least one")
    kept: list[dict] = []
    rep = PromptReport(source, len(items), limit)
    for where, row in items:
        try:
            n = int(prompt_len(row))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{where}: cannot tokenise the prompt: {e}") from None
        if n > limit.max_tokens:
            rep.dropped.append((where, n))
        else:
            kept.append(row)
            rep.longest = max(rep.longest, n)
    if rep.dropped and limit.policy == "error":
        raise ValueError(f"{source}: {rep.n_dropped} of {rep.total} prompts are longer than {limit.max_tokens} "
                         f"tokens ({limit.why}): {rep.rows_text()}; shorten them, raise the limit, or set "
                         f"data.overlong_prompts=drop to drop them")
    if not kept:
        raise ValueError(f"{source}: every one of its {rep.total} prompts is longer than {limit.max_tokens} tokens "
                         f"({limit.why}), e.g. {rep.rows_text()}")
    return kept, rep


def checked_prompts(dataset, prompt_field: str, prompt_len: Callable[[dict], int], limit: PromptLimit,
                    name: str = "dataset", **source) -> tuple[list[dict], PromptReport]:
    """Load (a path or Hub id; `source`: split, subset, field, as datasets.load_prompt_items takes)
    or take (a list of row dicts) prompt rows and check them: see check_prompts. Rows of a list
    are named `name[i]`; rows of a file by file and line."""
    if isinstance(dataset, (str, Path)):
        items = load_prompt_items(dataset, prompt_field, **source)
        source = str(dataset)
    else:
        items = [(f"{name}[{i}]", dict(r)) for i, r in enumerate(dataset)]
        source = name
    return check_prompts(items, prompt_len, limit, source)
