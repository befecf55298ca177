"""Several weighted reward functions applied to a batch of completions.

A reward function is called as `fn(prompts, completions, **row_fields, **kwargs)` where
each row field is a list with one value per sample (TRL's convention) and returns a list
of floats or None. The total is the weighted sum; a sample is masked (its total is nan)
when any reward returns None or nan for it. An exception in a function, or a malformed
return value, is caught: the error (with the batch's first sample) is reported and every
sample of that batch is masked for that reward; the run goes on.
"""

from __future__ import annotations

import importlib
import math
import traceback
from typing import Callable

import torch

from rlcu.rewards.format import format_reward
from rlcu.rewards.math import math_reward

BUILTIN = {"math": math_reward, "format": format_reward}


def load_reward(spec: str) -> Callable:
    """'math' | 'format' | 'module.path:function' -> the callable."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise ValueError(f"reward {spec!r}: expected a built-in ({', '.join(BUILTIN)}) or 'module.path:function'")
    mod_name, fn_name = spec.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {mod_name!r}: {e}") from None
    obj = mod
    for part in fn_name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward {spec!r}: module {mod_name!r} has no attribute {fn_name!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward {spec!r}: {fn_name!r} is not callable")
    return obj


def _short(x, n: int = 200) -> str:
    s = repr(x)
    return s if len(s) <= n else s[:n] + "..."


class RewardSet:
    """specs: a list of 'name' strings, callables, or dicts {name | fn, weight=1.0,
    kwargs={}} (`name` a built-in or 'module:function'; `fn` the same or a callable)."""

    def __init__(self, specs, on_error: Callable[[str], None] | None = None):
        if isinstance(specs, (str, dict)) or callable(specs):
            specs = [specs]
        if not specs:
            raise ValueError("rewards: at least one reward function is needed")
        self.names: list[str] = []
        self.fns: list[Callable] = []
        self.weights: list[float] = []
        self.kwargs: list[dict] = []
        for i, s in enumerate(specs):
            if isinstance(s, str) or callable(s):
                s = {"fn": s}
            if not isinstance(s, dict):
                raise ValueError(f"rewards[{i}] must be a name, 'module:function', a callable or a mapping, got {s!r}")
            bad = set(s) - {"name", "fn", "weight", "kwargs"}
            if bad:
                raise ValueError(f"rewards[{i}]: unknown key(s) {sorted(bad)} (known: name, fn, weight, kwargs)")
            fn = s.get("fn", s.get("name"))
            if fn is None:
                raise ValueError(f"rewards[{i}] needs `name` or `fn`")
            if isinstance(fn, str):
                name = s.get("name") if isinstance(s.get("name"), str) and "fn" in s else fn
                fn = load_reward(fn)
            else:
                name = s.get("name") or getattr(fn, "__name__", f"reward{i}")
            if isinstance(name, str) and ":" in name:
                name = name.split(":", 1)[1]
            w = s.get("weight", 1.0)
            if isinstance(w, bool) or not isinstance(w, (int, float)):
                raise ValueError(f"rewards[{i}].weight must be a number, got {w!r}")
            kw = s.get("kwargs") or {}
            if not isinstance(kw, dict):
                raise ValueError(f"rewards[{i}].kwargs must be a mapping, got {kw!r}")
            base, k = name, 2
            while name in self.names:
                name, k = f"{base}_{k}", k + 1
            self.names.append(name)
            self.fns.append(fn)
            self.weights.append(float(w))
            self.kwargs.append(dict(kw))
        self.on_error = on_error

    def __len__(self) -> int:
        return len(self.fns)

    def __call__(self, prompts: list, completions: list, rows: list[dict] | None = None):
        """-> (rewards: FloatTensor[n] with nan where masked, {name: FloatTensor[n]}, errors).
        `rows[i]` is the data row of sample i (its fields reach the functions)."""
        n = len(completions)
        if len(prompts) != n or (rows is not None and len(rows) != n):
            raise ValueError(f"rewards: {len(prompts)} prompts, {n} completions and "
                             f"{None if rows is None else len(rows)} rows must match")
        rows = rows or [{} for _ in range(n)]
        keys: list[str] = []
        for r in rows:
            keys += [k for k in r if k not in keys and k != "prompt"]
        fields = {k: [r.get(k) for r in rows] for k in keys}
        total = torch.zeros(n, dtype=torch.float64)
        breakdown: dict[str, torch.Tensor] = {}
        errors: list[str] = []
        for name, fn, w, kw in zip(self.names, self.fns, self.weights, self.kwargs):
            vals = torch.full((n,), math.nan, dtype=torch.float64)
            try:
                out = fn(prompts, completions, **{**fields, **kw})
                if out is None or not hasattr(out, "__len__") or len(out) != n:
                    raise ValueError(f"returned {_short(out, 80)}, expected a list of {n} floats or None")
                for i, v in enumerate(out):
                    if v is None:
                        continue
                    if hasattr(v, "item"):
                        v = v.item()
                    if isinstance(v, bool) or not isinstance(v, (int, float)):
                        raise ValueError(f"returned {v!r} for sample {i}, expected a float or None")
                    vals[i] = float(v)
            except Exception as e:
                vals.fill_(math.nan)
                tb = traceback.extract_tb(e.__traceback__)
                where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
                msg = (f"reward {name!r} failed ({type(e).__name__}: {e}){where}; its {n} samples are masked. "
                       f"First sample: prompt={_short(prompts[0] if n else None)} "
                       f"completion={_short(completions[0] if n else None)}")
                errors.append(msg)
                if self.on_error is not None:
                    self.on_error(msg)
            breakdown[name] = vals.float()
            total += w * vals  # nan propagates: a masked component masks the sample
        return total.float(), breakdown, errors
