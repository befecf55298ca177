"""How a reward function is called: TRL's GRPOTrainer convention, so that a function
written for TRL runs unchanged.

    fn(prompts=[...], completions=[...], completion_ids=[...], trainer_state=state,
       log_extra=..., log_metric=..., **dataset_columns, **spec_kwargs) -> list[float | None]

- `prompts[i]`: the row's prompt as the data holds it (a string, or chat messages).
- `completions[i]`: for a chat prompt, a list of one assistant message
  `[{"role": "assistant", "content": text}]` (TRL's conversational form); for a string
  prompt, the text; for a multi-turn episode, every message after the prompt (assistant
  turns with their `tool_calls`, `tool` results, the environment's `user` replies).
- `completion_ids[i]`: the sampled token ids.
- `trainer_state`: a TrainerState (`global_step`: steps done, `max_steps`, `epoch`).
- `log_extra(column, values)` and `log_metric(name, value)`: as in TRL (the metrics are
  logged under `rewards/<name>`).
- every other column of the rows (the prompt column aside) as a list with one value per
  sample; a spec's `kwargs` are passed as they are (not per sample) and win over a column
  of the same name.

Only what a function accepts reaches it: without **kwargs, the arguments it does not name
are left out (so `def f(completions, solution)` works). A function that names neither
`prompts` nor `completions` gets them positionally, `fn(prompts, completions, ...)`, the
older rlcu convention. An `async def` function is run to completion.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import traceback
from collections.abc import Callable

# the per-sample arguments (lists of n) and the per-call ones
BATCH_KEYS = ("prompts", "completions", "completion_ids")
CALL_KEYS = ("trainer_state", "log_extra", "log_metric")


@dataclasses.dataclass
class TrainerState:
    """The part of transformers' TrainerState that reward functions read."""

    global_step: int = 0  # optimizer steps done before this batch
    max_steps: int = 0
    epoch: float = 0.0  # passes over the training prompts so far


def as_completions(prompts: list, texts: list) -> list:
    """TRL's form: one assistant message per completion of a chat prompt, else the text; a
    completion given as messages (an episode's turns, tool results among them) stays as it is."""
    return [t if _is_chat(t) else [{"role": "assistant", "content": t}] if _is_chat(p) else t
            for p, t in zip(prompts, texts)]


def _is_chat(p) -> bool:
    return isinstance(p, (list, tuple)) and bool(p) and isinstance(p[0], dict)


class CallPlan:
    """Which of the offered arguments a function takes, and how."""

    def __init__(self, fn: Callable):
        self.fn = fn
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):  # a builtin without a signature: offer everything
            params = None
        if params is None:
            self.var_kw, self.names, self.required, self.positional = True, set(), [], False
            return
        P = inspect.Parameter
        self.var_kw = any(p.kind == P.VAR_KEYWORD for p in params)
        self.names = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
        # the older convention: fn(prompts, completions, ...) under other names
        self.positional = not ({"prompts", "completions"} & self.names)
        skip = 2 if self.positional else 0
        pos = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        if self.positional and len(pos) < 2 and not any(p.kind == P.VAR_POSITIONAL for p in params):
            self.positional, skip = False, 0  # e.g. def f(**kw): all by keyword
        taken = {p.name for p in pos[:skip]}
        self.required = [p.name for p in params if p.default is P.empty and p.name not in taken
                         and p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY, P.POSITIONAL_ONLY)]

    def missing(self, offered) -> list[str]:
        return [k for k in self.required if k not in offered]

    def args(self, kw: dict) -> tuple[tuple, dict]:
        if self.positional:
            rest = {k: v for k, v in kw.items() if k not in ("prompts", "completions")
                    and (self.var_kw or k in self.names)}
            return (kw["prompts"], kw["completions"]), rest
        return (), {k: v for k, v in kw.items() if self.var_kw or k in self.names}


def invoke(fn: Callable, plan: CallPlan, batch: dict, const: dict) -> tuple[object, dict]:
    """Call fn on one batch -> (its return value, {"metrics": {name: [v]}, "extra": {col: values}})."""
    logs: dict = {"metrics": {}, "extra": {}}

    def log_metric(name, value):
        logs["metrics"].setdefault(str(name), []).append(value)

    def log_extra(column, values):
        logs["extra"].setdefault(str(column), []).extend(values)

    kw = {**batch, **const, "log_metric": log_metric, "log_extra": log_extra}
    args, kwargs = plan.args(kw)
    out = fn(*args, **kwargs)
    if inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    return out, logs


async def _await(x):
    return await x


def describe(e: BaseException) -> str:
    """'TypeName: message at file:line' (the innermost frame)."""
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}: {e}{where}"
