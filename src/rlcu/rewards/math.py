"""The built-in `math` reward: 1.0 when the completion's final answer equals the row's
`answer` field, else 0.0; None (the sample is masked) when the row has no answer.

The final answer is the content of the last \\boxed{...} (braces matched), else the text
after the last "Answer:" on its line. Both sides are normalised (LaTeX wrappers, $, spaces,
thousands separators and trailing dots dropped, \\text{} unwrapped, \\frac{a}{b} -> a/b) and
compared as numbers when both parse (exact fractions, or floats with relative tolerance
1e-6), else as strings. When the `math_verify` package is installed it decides first.
"""

from __future__ import annotations

import re
from fractions import Fraction

_ANSWER_RE = re.compile(r"answer\s*[:：]\s*(.+)", re.IGNORECASE)


def _last_braced(text: str, cmd: str) -> str | None:
    i = text.rfind(cmd)
    while i >= 0:
        j = i + len(cmd)
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            depth, k = 0, j
            while k < len(text):
                if text[k] == "{":
                    depth += 1
                elif text[k] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[j + 1:k]
                k += 1
        i = text.rfind(cmd, 0, i)
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion: the last \\boxed{} (or \\fbox{}), else the last
    'Answer: ...' line; None when there is neither."""
    if not isinstance(text, str):
        return None
    for cmd in ("\\boxed", "\\fbox"):
        b = _last_braced(text, cmd)
        if b is not None:
            return b.strip()
    m = None
    for m in _ANSWER_RE.finditer(text):  # noqa: B007 - keeps the last match
        pass
    if m is not None:
        return m.group(1).strip()
    return None


def _unwrap(s: str, cmd: str) -> str:
    while True:
        i = s.find(cmd + "{")
        if i < 0:
            return s
        inner = _last_braced(s[i:], cmd)
        if inner is None:
            return s
        s = s[:i] + inner + s[i + len(cmd) + 2 + len(inner):]


def normalize_answer(s) -> str:
    s = str(s).strip()
    s = _unwrap(s, "\\boxed")
    for cmd in ("\\text", "\\textbf", "\\mathrm", "\\mbox"):
        s = _unwrap(s, cmd)
    s = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", s)
    for a, b in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\%", ""),
                 ("%", ""), ("$", ""), ("^\\circ", ""), ("^{\\circ}", ""), ("\\cdot", "*"), ("\\times", "*")):
        s = s.replace(a, b)
    s = re.sub(r"(\d),(\d{3})(?!\d)", r"\1\2", s)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".").lower()
    return s


def _as_number(s: str):
    t = s
    m = re.fullmatch(r"\(?([-+]?\d+)\)?/\(?([-+]?\d+)\)?", t)
    if m:
        d = int(m.group(2))
        return Fraction(int(m.group(1)), d) if d else None
    try:
        return Fraction(t) if re.fullmatch(r"[-+]?\d+(\.\d+)?", t) else float(t)
    except (ValueError, OverflowError):
        return None


def answers_match(pred, gold) -> bool:
    a, b = normalize_answer(pred), normalize_answer(gold)
    if a == b:
        return True
    x, y = _as_number(a), _as_number(b)
    if x is None or y is None:
        return False
    if isinstance(x, Fraction) and isinstance(y, Fraction):
        return x == y
    x, y = float(x), float(y)
    return abs(x - y) <= 1e-6 * max(1.0, abs(y))


def _math_verify(pred: str, gold: str) -> bool | None:
    try:
        from math_verify import parse, verify
    except ImportError:
        return None
    try:
        g = parse(gold if "$" in gold or "\\" in gold else f"${gold}$")
        p = parse(f"\\boxed{{{pred}}}")
        if not g or not p:
            return None
        return bool(verify(g, p))
    except Exception:
        return None


def _text(c) -> str:
    """A completion as text: a string, or chat messages (the last message's content)."""
    if isinstance(c, list) and c and isinstance(c[-1], dict):
        return str(c[-1].get("content", ""))
    return c if isinstance(c, str) else str(c)


def math_reward(prompts, completions, answer=None, answer_field: str = "answer", **fields) -> list[float | None]:
    """1.0 / 0.0 per completion against the gold answers (the row field `answer_field`, a
    list with one per sample); None where the gold answer is missing."""
    n = len(completions)
    if answer_field != "answer":
        answer = fields.get(answer_field)
    if answer is None:
        return [None] * n
    out: list[float | None] = []
    for c, gold in zip(completions, answer):
        if gold is None:
            out.append(None)
            continue
        pred = extract_answer(_text(c))
        if pred is None:
            out.append(0.0)
            continue
        mv = _math_verify(pred, str(gold))
        out.append(1.0 if (mv if mv is not None else answers_match(pred, gold)) else 0.0)
    return out
