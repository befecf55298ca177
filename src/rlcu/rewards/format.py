"""The built-in `format` reward: 1.0 when a completion is well formed, else 0.0.

Well formed means: it states a final answer the `math` reward can extract (\\boxed{...} or
"Answer: ..."), exactly once; and when it opens a <think> block, the block is closed
before the answer. `pattern=` (a regex, matched with re.search, DOTALL) replaces these
rules; `require_think=True` makes the think block mandatory.
"""

from __future__ import annotations

import re

from rlcu.rewards.math import _text, extract_answer


def _well_formed(text: str, require_think: bool) -> bool:
    ans = extract_answer(text)
    if ans is None:
        return False
    n_markers = text.count("\\boxed") + text.count("\\fbox")
    if n_markers == 0:
        n_markers = len(re.findall(r"answer\s*[:：]", text, re.IGNORECASE))
    if n_markers != 1:
        return False
    has_open = "<think>" in text
    if require_think and not has_open:
        return False
    if has_open:
        close = text.find("</think>")
        if close < 0 or text.count("<think>") != 1 or close < text.find("<think>"):
            return False
        marker = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
        if marker < 0:
            marker = max((m.start() for m in re.finditer(r"answer\s*[:：]", text, re.IGNORECASE)), default=-1)
        if marker < close:
            return False
    return True


def format_reward(prompts, completions, pattern: str | None = None, require_think: bool = False,
                  **_) -> list[float]:
    out = []
    for c in completions:
        t = _text(c)
        if pattern is not None:
            out.append(1.0 if re.search(pattern, t, re.DOTALL) else 0.0)
        else:
            out.append(1.0 if _well_formed(t, require_think) else 0.0)
    return out
