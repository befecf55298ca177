"""The rows a trainer trains and evaluates on, and their order; SFT and RL read them the same way.

Where they come from (`load_rows`): the training rows are the `dataset` given to the trainer,
else `data.path`; the held-out rows are the `eval_dataset` given, else `data.eval_path`, else
`data.eval_size` rows drawn off the training rows by a seeded permutation (`split_eval`). What
a row is (an SFT example, a checked prompt) is the trainer's: it passes the function that loads
one source.

Their order (`EpochOrder`; `PromptSampler` draws RL prompts by it): a seeded permutation per
epoch, a function of (seed, epoch) only, so that a data position (epoch and cursor, or one
running count) is the whole data state and a resumed run reads the rows in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


class EpochOrder:
    """order(epoch): the indices of n rows in that epoch's order, a permutation seeded by
    (seed, epoch) or, without shuffle, the rows' own order. The last epoch's is kept."""

    def __init__(self, n: int, seed: int, shuffle: bool = True):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._epoch, self._order = -1, []

    def __call__(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._order = torch.randperm(self.n, generator=g).tolist()
            else:
                self._order = list(range(self.n))
            self._epoch = epoch
        return self._order


class EpochCursor:
    """A data position, (epoch, cursor) into that epoch's `EpochOrder` of n rows: the whole state
    of a stream that draws rows by it (SFT's packed examples, the reward trainer's pairs)."""

    def __init__(self, n: int, seed: int, shuffle: bool):
        self.epoch, self.cursor = 0, 0
        self._order = EpochOrder(n, seed, shuffle)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, d: dict) -> None:
        self.epoch, self.cursor = int(d["epoch"]), int(d["cursor"])


class PromptSampler:
    """Rows in a seeded random order, epoch after epoch; the state is one integer."""

    def __init__(self, rows: list[dict], seed: int, shuffle: bool = True, pos: int = 0):
        if not rows:
            raise ValueError("the prompt dataset is empty")
        self.rows, self.pos = rows, pos
        self._order = EpochOrder(len(rows), seed, shuffle)

    def next(self, k: int) -> list[dict]:
        out = []
        n = len(self.rows)
        for _ in range(k):
            e, i = divmod(self.pos, n)
            out.append(self.rows[self._order(e)[i]])
            self.pos += 1
        return out


def split_eval(rows: list, eval_size: int, seed: int, src: str = "the data") -> tuple[list, list]:
    """(train rows, held-out rows): `eval_size` rows drawn by a seeded permutation, both in
    their file order."""
    if eval_size <= 0:
        return rows, []
    if eval_size >= len(rows):
        raise ValueError(f"data.eval_size ({eval_size}) must be smaller than the {len(rows)} rows of {src}")
    g = torch.Generator().manual_seed(seed + 7919)
    held = set(torch.randperm(len(rows), generator=g)[:eval_size].tolist())
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def source_name(source) -> str:
    """How messages name a source: its path, or `dataset` for rows given as a list (whose
    rows are named dataset[i])."""
    return str(source) if isinstance(source, (str, Path)) else "dataset"


def load_rows(d, dataset, eval_dataset, load: Callable[..., list], who: str) -> tuple[list, list, str]:
    """(training rows, held-out rows, the training source's name) under the data section `d`
    (rlcu.config.DataConfig). load(source, name, split=, subset=, field=) reads one source
    (rows given as a list, a file, a dataset folder or Hub id); `name` names a list's rows
    (dataset[i], eval_dataset[i]); `field` is the option a path came from, so that its errors
    name it (None for a source passed in). `who` names the trainer when there is no data."""
    if dataset is None:
        if d.path is None:
            raise ValueError(f"{who} needs data: pass dataset= or set data.path")
        dataset = d.path
    rows = load(dataset, "dataset", split=d.split, subset=d.subset, field="data.path" if dataset is d.path else None)
    if eval_dataset is None:
        eval_dataset = d.eval_path
    if eval_dataset is None:
        return (*split_eval(rows, d.eval_size, d.seed, source_name(dataset)), source_name(dataset))
    eval_rows = load(eval_dataset, "eval_dataset", split=d.eval_split, subset=d.subset,
                     field="data.eval_path" if eval_dataset is d.eval_path else None)
    return rows, eval_rows, source_name(dataset)
