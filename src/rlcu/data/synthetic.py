"""Built-in synthetic tasks with verifiable answers, for the demo and the tests.

`sort`: the prompt lists k digits (k in [min_len, max_len]) and the answer is the same
digits in ascending order, e.g.
    prompt  "sort 3 9 1 4 3 :"      answer  "1 3 3 4 9"
A tiny transformer learns it from a few hundred SFT steps to partial accuracy (it must find,
at each position, the smallest digit not yet written, counting repeats); the exact-match
reward then lets GRPO push the accuracy up. Every token is a whole word of a word-level
vocabulary (`make_tokenizer`), so the model needs no subword machinery.

Train and held-out prompts come from disjoint sets (split by a hash of the digits), so
held-out accuracy measures the learned procedure, not memorised pairs.

`sort_preference_rows`: the same prompts as preference pairs for reward models and DPO, the
chosen answer sorted, the rejected one the same digits out of order, so that a reward model
learns "ascending" (and a policy scored by it learns to sort).
"""

from __future__ import annotations

import hashlib
import random

DIGITS = [str(i) for i in range(10)]
WORDS = DIGITS + ["sort", ":"]
SPECIAL = ["<|endoftext|>", "<|im_end|>"]  # pad, eos (Qwen3's names)


def make_tokenizer():
    """The word-level tokenizer of the tasks (id 0 is <unk>; eos is <|im_end|>)."""
    from rlcu.data.tokenizer import make_word_tokenizer

    return make_word_tokenizer(WORDS, special_tokens=SPECIAL)


def _held_out(digits: list[int], eval_frac: float) -> bool:
    h = hashlib.blake2b(bytes(digits), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64 < eval_frac


def sort_rows(n: int, split: str = "train", seed: int = 0, min_len: int = 3, max_len: int = 6,
              eval_frac: float = 0.2, distinct: bool = False, sloppy: float = 0.0,
              sloppy_min_len: int = 0) -> list[dict]:
    """n rows {prompt, completion, answer} of the sort task from `split` ("train" | "eval").
    distinct: the digits of a prompt are all different (max_len <= 10). sloppy: the
    fraction of rows with at least `sloppy_min_len` digits whose `completion` (the SFT
    demonstration) forgets the last, largest digit; `answer` (what the reward checks) is
    always right."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    rng = random.Random(f"sort-{split}-{seed}")
    rows = []
    tries = 0
    while len(rows) < n:
        tries += 1
        if tries > 1000 * n + 10000:
            raise ValueError(f"could not draw {n} distinct-split rows; lower n or raise max_len")
        k = rng.randint(min_len, max_len)
        d = rng.sample(range(10), k) if distinct else [rng.randrange(10) for _ in range(k)]
        if _held_out(d, eval_frac) != (split == "eval"):
            continue
        s = sorted(d)
        ans = " ".join(str(x) for x in s)
        demo = " ".join(str(x) for x in s[:-1]) if k >= sloppy_min_len and rng.random() < sloppy else ans
        rows.append({"prompt": "sort " + " ".join(str(x) for x in d) + " :", "completion": " " + demo,
                     "answer": ans})
    return rows


def sort_preference_rows(n: int, split: str = "train", seed: int = 0, min_len: int = 3, max_len: int = 6,
                         eval_frac: float = 0.2) -> list[dict]:
    """n rows {prompt, chosen, rejected} (TRL's preference format) of the sort task's `split`:
    chosen is the sorted answer; rejected the same digits descending or in another order that is
    not ascending (drawn half and half)."""
    rng = random.Random(f"sort-pref-{split}-{seed}")
    rows = []
    for r in sort_rows(4 * n + 64, split, seed, max(min_len, 2), max_len, eval_frac):
        d = [int(x) for x in r["answer"].split()]
        if len(set(d)) < 2:
            continue  # every order of one repeated digit is sorted
        bad = desc = sorted(d, reverse=True)
        if rng.random() < 0.5:
            for _ in range(20):  # another order, where there is one (else descending)
                bad = rng.sample(d, len(d))
                if bad not in (sorted(d), desc):
                    break
            else:
                bad = desc
        rows.append({"prompt": r["prompt"], "chosen": " " + r["answer"], "rejected": " " + " ".join(map(str, bad))})
        if len(rows) == n:
            return rows
    raise ValueError(f"could not draw {n} preference rows of the sort task; raise max_len")


def normalise(text: str) -> str:
    return " ".join(str(text).split())


def exact_match_reward(prompts, completions, answer, **_) -> list[float]:
    """1.0 when the completion (whitespace-normalised) equals the answer, else 0.0."""
    return [1.0 if normalise(c) == normalise(a) else 0.0 for c, a in zip(completions, answer)]


def partial_match_reward(prompts, completions, answer, **_) -> list[float]:
    """The fraction of answer positions the completion gets right, minus a penalty for a
    wrong length: a denser signal than exact match."""
    out = []
    for c, a in zip(completions, answer):
        cw, aw = normalise(c).split(), normalise(a).split()
        hits = sum(x == y for x, y in zip(cw, aw))
        out.append(hits / max(len(aw), 1) - 0.5 * min(abs(len(cw) - len(aw)), 2) / 2)
    return out
