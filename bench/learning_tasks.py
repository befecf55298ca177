"""The two tasks of bench/learning.py: their prompts, tokenizer, model shape and warm-up.

demo  rlcu's demo (rlcu.train.demo, rlcu.data.synthetic `sort`): sort 4-8 distinct digits, a
      sloppy SFT teacher that drops the largest digit of 6+ digit lists 70% of the time;
      completions of 5-9 tokens (one word a token, plus <|im_end|>).
long  the same procedure at about five times the length: sort 24-40 distinct numbers drawn from
      0..47 (each number one word of the vocabulary), a teacher that drops the largest number of
      30+ number lists 70% of the time; completions of 24-41 tokens, so a sequence's log-ratio sums
      about 5x as many per-token mismatches as the demo's.

A task's held-out prompts are disjoint from its training prompts (split by a hash of the list).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    about: str
    min_len: int
    max_len: int
    symbols: int  # the list's items are the words 0 .. symbols-1
    sloppy: float
    sloppy_min_len: int
    model: dict  # Qwen3Config fields (vocab_size and eos come from the tokenizer)
    sft_steps: int
    sft_lr: float = 3e-3
    sft_batch_tokens: int = 1024
    n_train: int = 4000
    n_eval: int = 200

    @property
    def max_new_tokens(self) -> int:
        return self.max_len + 2

    def tokenizer(self):
        from rlcu.data import synthetic as syn
        from rlcu.data.tokenizer import make_word_tokenizer

        if self.symbols == 10:
            return syn.make_tokenizer()  # the demo's own
        return make_word_tokenizer([str(i) for i in range(self.symbols)] + ["sort", ":"],
                                   special_tokens=syn.SPECIAL)

    def rows(self, split: str, seed: int) -> list[dict]:
        from rlcu.data import synthetic as syn

        n = self.n_train if split == "train" else self.n_eval
        if self.symbols == 10:
            return syn.sort_rows(n, split, seed=seed, min_len=self.min_len, max_len=self.max_len, distinct=True,
                                 sloppy=self.sloppy, sloppy_min_len=self.sloppy_min_len)
        return _sort_rows(n, split, seed, self)

    def scaled(self, **kw) -> Task:
        return dataclasses.replace(self, **kw)


def _held_out(items: list[int], frac: float = 0.2) -> bool:
    h = hashlib.blake2b(bytes(items), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64 < frac


def _sort_rows(n: int, split: str, seed: int, t: Task) -> list[dict]:
    """rlcu.data.synthetic.sort_rows' rows for `symbols` distinct items (< 256)."""
    rng = random.Random(f"sort{t.symbols}-{split}-{seed}")
    rows = []
    while len(rows) < n:
        k = rng.randint(t.min_len, t.max_len)
        d = rng.sample(range(t.symbols), k)
        if _held_out(d) != (split == "eval"):
            continue
        s = sorted(d)
        ans = " ".join(map(str, s))
        demo = " ".join(map(str, s[:-1])) if k >= t.sloppy_min_len and rng.random() < t.sloppy else ans
        rows.append({"prompt": "sort " + " ".join(map(str, d)) + " :", "completion": " " + demo, "answer": ans})
    return rows


def _demo() -> Task:
    from rlcu.config import DemoConfig

    c = DemoConfig()
    t = c.task
    return Task("demo", "sort 4-8 distinct digits (rlcu demo); the SFT teacher drops the largest digit of 6+ digit "
                        "lists 70% of the time", t.min_len, t.max_len, 10, t.sloppy, t.sloppy_min_len, dict(c.model),
                c.sft_steps, c.sft_lr, c.sft_batch_tokens, t.n_train, t.n_eval)


def _long() -> Task:
    from rlcu.config import MODEL

    return Task("long", "sort 24-40 distinct numbers of 0..47; the SFT teacher drops the largest number of 30+ number "
                        "lists 70% of the time", 24, 40, 48, 0.7, 30, {**MODEL, "max_position_embeddings": 128}, 150,
                sft_batch_tokens=2048)


def get(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {name!r}")
    return TASKS[name]()


TASKS = {"demo": _demo, "long": _long}
