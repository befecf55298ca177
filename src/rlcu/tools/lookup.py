"""The lookup task: a built-in multi-turn task with a tool (issue 36) that a tiny model learns on
the CPU. The model is asked for a person's code; the code is random per episode and is only in
the answer of the `lookup` tool, so an episode succeeds only when the model calls the tool with
the right name and then copies the code it returns:

    user       code of bob ?
    assistant  <tool_call> {"name": "lookup", "arguments": {"name": "bob"}} </tool_call>
    tool       4 7 1
    assistant  4 7 1

The tool call is Qwen's format, parsed by rlcu.tools.calls for the qwen3 family as any Qwen3's
is. The word-level tokenizer (`make_tokenizer`) writes it from a handful of tokens: the quoted
JSON strings (`"name"`, `"lookup"`, `"bob"`, ...) are tokens of their own, since its whitespace
pre-tokenizer would split a quote from its word and its decoder joins tokens with spaces, which
would put spaces inside the strings. Decoded, a call reads `{ "name" : "lookup" , ... }`: JSON.
The chat template (`CHAT_TEMPLATE`, ChatML) renders tool calls this way and tool results as a
`tool` turn.

The SFT rows (`sft_rows`) come from a sloppy teacher: for the names in the second half of
NAMES it answers `sloppy` of the time at once, without the tool, with a stale code it remembers. A model
warmed up on them calls the tool for the first half and guesses (greedily) for the second, so its
held-out success is about half; GRPO with the environment's reward (1 for the right code, else 0)
then learns to call the tool for every name. Held-out rows draw their codes from a stream of
their own: the prompts repeat, the tool's answers are never seen in training.
"""

from __future__ import annotations

import random

NAMES = ("ann", "bob", "cid", "dan", "eve", "fay", "gus", "hal", "ivy", "jon", "kim", "lea", "max", "ned",
         "oli", "pam")
DIGITS = [str(i) for i in range(10)]
WORDS = DIGITS + list(NAMES) + ["code", "of", "?", "user", "assistant", "tool", "system", "{", "}", ":", ","]
QUOTED = ['"name"', '"arguments"', '"lookup"'] + [f'"{n}"' for n in NAMES]
SPECIAL = ["<|endoftext|>", "<|im_end|>", "<|im_start|>", "<tool_call>", "</tool_call>"] + QUOTED

CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for tc in m.tool_calls or [] %}"
    "{{- '<tool_call> { \"name\" : \"' + tc.function.name + '\" , \"arguments\" : {' }}"
    "{%- for k, v in tc.function.arguments.items() %}"
    "{{- (' , ' if not loop.first else ' ') + '\"' + k + '\" : \"' + v|string + '\"' }}"
    "{%- endfor %}"
    "{{- ' } } </tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def make_tokenizer():
    """The task's word-level tokenizer with its chat template (eos <|im_end|>)."""
    from rlcu.data.tokenizer import make_word_tokenizer

    return make_word_tokenizer(WORDS, special_tokens=SPECIAL, chat_template=CHAT_TEMPLATE)


def _code(rng: random.Random, digits: int) -> str:
    return " ".join(rng.choice(DIGITS) for _ in range(digits))


def book(seed: int, digits: int = 3) -> dict[str, str]:
    """An episode's phone book: every name's code, drawn from `seed`."""
    rng = random.Random(f"lookup-book-{seed}")
    return {n: _code(rng, digits) for n in NAMES}


def rows(n: int, split: str = "train", seed: int = 0, digits: int = 3) -> list[dict]:
    """n GRPO rows {prompt, name, book_seed, digits, answer} of `split` ("train" | "eval"), whose
    phone books come from disjoint seeds (even for train, odd for eval)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"lookup-{split}-{seed}")
    out = []
    for _ in range(n):
        name = rng.choice(NAMES)
        bseed = 2 * rng.randrange(1 << 40) + (split == "eval")
        out.append({"prompt": [{"role": "user", "content": f"code of {name} ?"}], "name": name, "book_seed": bseed,
                    "digits": digits, "answer": book(bseed, digits)[name]})
    return out


def is_sloppy_name(name: str) -> bool:
    """The names the SFT teacher is sloppy on: the second half of NAMES."""
    return NAMES.index(name) >= len(NAMES) // 2


def stale_code(name: str, digits: int = 3) -> str:
    """The code the sloppy teacher remembers for `name`: one fixed code a name, from no episode's book."""
    return book(-1, digits)[name]


def sft_rows(n: int, seed: int = 0, digits: int = 3, sloppy: float = 0.7) -> list[dict]:
    """n SFT conversations {messages} of the sloppy teacher: a call, the tool's answer and the
    code copied; or, for a sloppy name `sloppy` of the time, the code it remembers (`stale_code`,
    the same for every episode, so a greedy model that learned it answers it) without the tool."""
    rng = random.Random(f"lookup-sft-{seed}")
    out = []
    for r in rows(n, "train", seed + 1, digits):
        msgs = list(r["prompt"])
        if is_sloppy_name(r["name"]) and rng.random() < sloppy:
            msgs.append({"role": "assistant", "content": stale_code(r["name"], digits)})
        else:
            call = {"type": "function", "function": {"name": "lookup", "arguments": {"name": r["name"]}}}
            msgs += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "name": "lookup", "content": r["answer"]},
                     {"role": "assistant", "content": r["answer"]}]
        out.append({"messages": msgs})
    return out


def normalise(text) -> str:
    return " ".join(str(text or "").split())


class Lookup:
    """The task's environment: one episode's phone book (from the row), the `lookup` tool, and the
    reward: 1.0 when the model's last message is the asked name's code, else 0.0."""

    def __init__(self):
        self.codes: dict[str, str] = {}
        self.answer = None

    def reset(self, row):
        self.codes = book(int(row["book_seed"]), int(row.get("digits", 3)))
        self.answer = self.codes[row["name"]]
        return None  # the row's prompt is the first message

    def lookup(self, name: str) -> str:
        """Look up a person's code.

        Args:
            name: The person's name.
        """
        return self.codes.get(name, "unknown")

    def reward(self, messages) -> float:
        last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
        return float(last is not None and not last.get("tool_calls") and normalise(last.get("content")) == self.answer)


def success_reward(prompts, completions, answer, **_) -> list[float]:
    """The same success as a reward function over TRL's conversation form: the last assistant
    message (without a tool call) is the code."""
    out = []
    for msgs, a in zip(completions, answer):
        last = next((m for m in reversed(msgs) if m.get("role") == "assistant"), {})
        out.append(float(not last.get("tool_calls") and normalise(last.get("content")) == normalise(a)))
    return out


def write(out: str, n_sft: int = 3000, n_train: int = 2000, n_eval: int = 128, seed: int = 0) -> None:
    """The task's files for `rlcu sft` / `rlcu grpo` (examples/lookup/): OUT/tokenizer (with its chat
    template), OUT/sft.jsonl (the sloppy teacher's conversations), OUT/train.jsonl and OUT/eval.jsonl
    (GRPO's rows: the prompt and what the environment reads)."""
    import json
    from pathlib import Path

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    make_tokenizer().save_pretrained(root / "tokenizer")
    for name, rs in (("sft", sft_rows(n_sft, seed, sloppy=0.9)), ("train", rows(n_train, "train", seed)),
                     ("eval", rows(n_eval, "eval", seed))):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))


if __name__ == "__main__":
    import sys

    write(sys.argv[1] if len(sys.argv) > 1 else "runs/lookup/data")
