"""Several weighted reward functions applied to a batch of completions.

Each function is called as TRL's GRPOTrainer calls it (see call.py for the signature) and
returns one float or None per sample. Per function and per sample, a value is one of:

- a finite number: it counts, times the function's weight;
- None: the function does not apply to that sample (TRL's convention, e.g. a math reward
  on a code prompt); the sample's total is the weighted sum of the functions that scored
  it, and a sample that no function scored is masked;
- a failure: the function raised, returned nan or inf, a value that is not a number, or the wrong
  number of values, or did not return within `timeout_s`. The sample is masked (its total
  is nan: a sum without one of its terms would silently mean something else), the failure
  is counted (`reward_failed/<name>`) and reported with the sample's prompt and completion.

A reward model (`{model: FOLDER}`, rewards/model_reward.py) is an entry like a function: its
score per sample times its weight, its failures (a sample it cannot read, a forward that raises,
a non-finite score) masked and counted the same way.

A function that raises on the whole batch is called again one sample at a time, so that
the samples it can score survive (a late call is not: a hang would only repeat). When a
function fails on every sample of `max_failed_steps` steps in a row, the call raises
RewardsFailed naming the function and the first error of that streak; the trainer and the
CLI stop the run with exit status 1.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rlcu.config_hints import hint, hint_text
from rlcu.rewards.call import BATCH_KEYS, CALL_KEYS, CallPlan, as_completions, describe
from rlcu.rewards.loader import BUILTIN, load_reward
from rlcu.rewards.model_reward import ModelReward, check_spec
from rlcu.rewards.runner import CallTimeout, make_runner


class RewardsFailed(RuntimeError):
    """A reward function failed on every sample for too many steps in a row."""

    def __init__(self, name: str, steps: int, first_error: str):
        self.name, self.steps, self.first_error = name, steps, first_error
        super().__init__(f"reward {name!r} failed on every sample for {steps} steps in a row "
                         f"(reward_max_failed_steps); its first error: {first_error}")


def reward_options(cfg) -> dict:
    """RewardSet keyword arguments from a run config's reward_* fields."""
    return {"timeout_s": getattr(cfg, "reward_timeout_s", None), "workers": getattr(cfg, "reward_workers", "main"),
            "max_failed_steps": getattr(cfg, "reward_max_failed_steps", 3)}


def _as_float(x) -> float | None:
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _a_list_of(n: int) -> str:
    """What a call must return (None is a sample's value, not the call's: a bare None reads as
    allowed when the message says "floats or None")."""
    return (f"a list of {n} value{'s' if n != 1 else ''}, one per sample: a float, or None for a sample the "
            f"function does not score")


def _short(x, n: int = 200) -> str:
    s = repr(x)
    return s if len(s) <= n else s[:n] + "..."


@dataclasses.dataclass
class _Fn:
    name: str
    fn: Callable
    weight: float
    kwargs: dict
    runner: object
    plan: CallPlan
    streak: int = 0
    streak_step: object = None
    streak_error: str = ""
    model: ModelReward | None = None  # a reward model's entry (fn, runner and plan unused)


class RewardSet:
    """specs: a list of 'name' strings, callables, or dicts {name | fn, weight=1.0,
    kwargs={}} (`name` a built-in or 'module:function'; `fn` the same or a callable).
    timeout_s: most seconds a call may take (None: no limit; the built-ins run without one);
    workers: 'main', 'thread' or 'process' (see runner.py); max_failed_steps: 0 never stops.
    A reward model is a dict {model: FOLDER or RewardModel, weight, batch_size, max_tokens,
    offload, kwargs} (rewards/model_reward.py), loaded with `model_kw` (device, dtype,
    policy_tokenizer, max_tokens: the default of its entries)."""

    def __init__(self, specs, on_error: Callable[[str], None] | None = None, *, timeout_s: float | None = None,
                 workers: str = "main", max_failed_steps: int = 3, model_kw: dict | None = None):
        if isinstance(specs, (str, dict)) or callable(specs):
            specs = [specs]
        if not specs:
            raise ValueError("rewards: at least one reward function is needed")
        self.timeout_s, self.max_failed_steps = timeout_s, int(max_failed_steps)
        self.model_kw = dict(model_kw or {})
        self.fns: list[_Fn] = []
        for i, s in enumerate(specs):
            self.fns.append(self._entry(i, s, workers))
        self.on_error = on_error
        self.last_metrics: dict[str, float] = {}
        self.last_extra: dict[str, dict] = {}
        self._calls = 0

    def _entry(self, i: int, s, workers: str) -> _Fn:
        if isinstance(s, str) or callable(s):
            s = {"fn": s}
        if not isinstance(s, dict):
            raise ValueError(f"rewards[{i}] must be a name, 'module:function', a callable or a mapping, got {s!r}")
        if "model" in s:
            return self._model_entry(i, s)
        known = ["name", "fn", "weight", "kwargs"]
        bad = sorted(map(str, set(s) - set(known)))
        if bad:
            near = hint_text(bad[0], hint(bad[0], known, known), f"rewards[{i}]")
            raise ValueError(f"rewards[{i}]: unknown key(s) {bad}{near} (known: {', '.join(known)})")
        fn = s.get("fn", s.get("name"))
        if fn is None:
            raise ValueError(f"rewards[{i}] needs `name` or `fn`")
        spec = fn if isinstance(fn, str) else None
        if spec is not None:
            name = s.get("name") if isinstance(s.get("name"), str) and "fn" in s else fn
            fn = load_reward(spec)
        else:
            name = s.get("name") or getattr(fn, "__name__", f"reward{i}")
        if isinstance(name, str) and ":" in name:
            name = name.split(":", 1)[1]
        w = s.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"rewards[{i}].weight must be a finite number, got {w!r}")
        kw = s.get("kwargs") or {}
        if not isinstance(kw, dict):
            raise ValueError(f"rewards[{i}].kwargs must be a mapping, got {kw!r}")
        base, k = name, 2
        while name in self.names:
            name, k = f"{base}_{k}", k + 1
        builtin = any(fn is b for b in BUILTIN.values())
        runner = make_runner(fn, spec, builtin, workers, self.timeout_s)
        return _Fn(name, fn, float(w), dict(kw), runner, CallPlan(fn))

    def _model_entry(self, i: int, s: dict) -> _Fn:
        field = f"rewards[{i}]"
        check_spec(s, field)
        w = s.get("weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"{field}.weight must be a finite number, got {w!r}")
        kw = dict(self.model_kw)
        run_tokens = kw.pop("max_tokens", None)
        max_tokens = s.get("max_tokens") or run_tokens  # the entry's, else the run's
        src = s["model"]
        m = src if isinstance(src, ModelReward) else ModelReward.load(
            src, f"{field}.model", max_tokens=max_tokens, batch_size=s.get("batch_size"),
            offload=s.get("offload", "auto"), template_kwargs=s.get("kwargs"), **kw)
        base = s.get("name") or (Path(str(src)).name if isinstance(src, (str, Path)) else "reward_model")
        name, k = base, 2
        while name in self.names:
            name, k = f"{base}_{k}", k + 1
        return _Fn(name, m, float(w), {}, None, None, model=m)

    @property
    def models(self) -> list[ModelReward]:
        """The reward models among the entries."""
        return [f.model for f in self.fns if f.model is not None]

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fns]

    @property
    def weights(self) -> list[float]:
        return [f.weight for f in self.fns]

    def __len__(self) -> int:
        return len(self.fns)

    def close(self) -> None:
        """Stop the worker processes (reward_workers=process)."""
        for f in self.fns:
            if f.runner is not None:
                f.runner.close()

    # ---------------------------------------------------------------- scoring
    def __call__(self, prompts: list, completions: list, rows: list[dict] | None = None, *,
                 completion_ids: list | None = None, trainer_state=None, prompt_field: str = "prompt",
                 sequence_ids: list | None = None):
        """-> (rewards: FloatTensor[n], nan where masked; {name: FloatTensor[n]}, nan where the
        function gave no value; [one message per function that failed on some sample]).
        `completions` are texts (chat prompts get them as assistant messages); `rows[i]` is
        sample i's data row, whose columns other than `prompt_field` reach the functions;
        `sequence_ids[i]` the policy's whole sequence (prompt and completion ids), which a reward
        model reads when it shares the policy's tokenizer."""
        n = len(completions)
        if len(prompts) != n or (rows is not None and len(rows) != n) or \
                (completion_ids is not None and len(completion_ids) != n):
            raise ValueError(f"rewards: {len(prompts)} prompts, {n} completions, "
                             f"{None if rows is None else len(rows)} rows and "
                             f"{None if completion_ids is None else len(completion_ids)} completion_ids must match")
        rows = rows or [{} for _ in range(n)]
        keys: list[str] = []
        for r in rows:
            keys += [k for k in r if k not in keys and k != prompt_field and k not in BATCH_KEYS + CALL_KEYS]
        columns = {k: [r.get(k) for r in rows] for k in keys}
        batch = {**columns, "prompts": list(prompts), "completions": as_completions(prompts, completions),
                 "completion_ids": [list(c) for c in completion_ids] if completion_ids is not None else [None] * n}
        self._calls += 1
        step = getattr(trainer_state, "global_step", None) if trainer_state is not None else None
        step = ("call", self._calls) if step is None else step
        total = torch.zeros(n, dtype=torch.float64)
        scored = torch.zeros(n, dtype=torch.bool)
        failed = torch.zeros(n, dtype=torch.bool)
        breakdown: dict[str, torch.Tensor] = {}
        errors: list[str] = []
        self.last_metrics, self.last_extra = {}, {}
        for f in self.fns:
            if f.model is not None:
                t0 = time.perf_counter()
                vals, fails, note, logs = self._score_model(f, batch, sequence_ids, n)
                self.last_metrics[f"time/reward/{f.name}"] = time.perf_counter() - t0
            else:
                vals, fails, note, logs = self._score(f, batch, trainer_state, n)
            ok = ~torch.isnan(vals)
            total[ok] += f.weight * vals[ok]
            scored |= ok
            bad = torch.tensor([i in fails for i in range(n)], dtype=torch.bool)
            failed |= bad
            breakdown[f.name] = vals.float()
            for k, v in logs.get("metrics", {}).items():
                fv = [x for x in map(_as_float, v) if x is not None]
                if fv:
                    self.last_metrics[f"rewards/{k}"] = sum(fv) / len(fv)
            if logs.get("extra"):
                self.last_extra[f.name] = logs["extra"]
            if fails:
                self.last_metrics[f"reward_failed/{f.name}"] = float(len(fails))
                msg = self._message(f, fails, note, prompts, completions, n)
                errors.append(msg)
                if self.on_error is not None:
                    self.on_error(msg)
            self._track(f, step, n > 0 and len(fails) == n, fails, note)
        total[~scored | failed] = math.nan
        return total.float(), breakdown, errors

    def _score(self, f: _Fn, batch: dict, trainer_state, n: int):
        """-> (values [n] float64, nan where none; {sample: reason}; a note on the batch call; logs)."""
        vals = torch.full((n,), math.nan, dtype=torch.float64)
        if n == 0:
            return vals, {}, "", {}
        offered = set(batch) | set(f.kwargs) | set(CALL_KEYS)
        miss = f.plan.missing(offered)
        if miss:
            cols = ", ".join(k for k in batch if k not in BATCH_KEYS) or "none"
            why = (f"needs argument(s) {', '.join(map(repr, miss))}, which neither the rows (columns: {cols}) "
                   f"nor its kwargs give")
            return vals, {i: why for i in range(n)}, "", {}
        const = {**f.kwargs, "trainer_state": trainer_state}
        batch = {k: v for k, v in batch.items() if k not in f.kwargs}
        try:
            out, logs = f.runner.call(batch, const, self.timeout_s)
        except CallTimeout as e:
            return vals, {i: str(e) for i in range(n)}, "", {}
        except Exception as e:  # noqa: BLE001 - the user's function: retry one sample at a time
            return self._retry(f, batch, const, n, describe(e))
        if isinstance(out, torch.Tensor):
            out = out.tolist()
        if out is None or isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or len(out) != n:
            why = f"returned {_short(out, 80)}, expected {_a_list_of(n)}"
            return vals, {i: why for i in range(n)}, "", logs
        fails = {}
        for i, v in enumerate(out):
            r = self._value(v)
            if isinstance(r, str):
                fails[i] = r
            else:
                vals[i] = r
        return vals, fails, "", logs

    @staticmethod
    def _score_model(f: _Fn, batch: dict, sequence_ids: list | None, n: int):
        """A reward model's entry: as `_score` returns."""
        vals = torch.full((n,), math.nan, dtype=torch.float64)
        if n == 0:
            return vals, {}, "", {}
        out, fails = f.model(batch["prompts"], batch["completions"], sequence_ids)
        vals[:] = torch.tensor(out, dtype=torch.float64)
        return vals, fails, "", {}

    def _retry(self, f: _Fn, batch: dict, const: dict, n: int, batch_error: str):
        vals = torch.full((n,), math.nan, dtype=torch.float64)
        fails: dict[int, str] = {}
        logs: dict = {"metrics": {}, "extra": {}}
        for i in range(n):
            one = {k: v[i:i + 1] for k, v in batch.items()}
            try:
                out, lg = f.runner.call(one, const, self.timeout_s)
            except CallTimeout as e:
                fails.update({j: f"{e} (retrying one sample at a time)" for j in range(i, n)})
                break
            except Exception as e:  # noqa: BLE001
                fails[i] = describe(e)
                continue
            for part in ("metrics", "extra"):
                for k, v in lg.get(part, {}).items():
                    logs[part].setdefault(k, []).extend(v)
            if isinstance(out, torch.Tensor):
                out = out.tolist()
            if out is None or isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or len(out) != 1:
                fails[i] = f"returned {_short(out, 80)} for one sample, expected {_a_list_of(1)}"
                continue
            r = self._value(out[0])
            if isinstance(r, str):
                fails[i] = r
            else:
                vals[i] = r
        note = f"the batch call raised {batch_error}; called again one sample at a time: {n - len(fails)} of {n} ok"
        return vals, fails, note, logs

    @staticmethod
    def _value(v):
        """A float (nan for None: no value), or the reason it is a failure."""
        if v is None:
            return math.nan
        if hasattr(v, "item") and not isinstance(v, (list, tuple)):
            try:
                v = v.item()
            except (ValueError, TypeError):
                pass
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"returned {_short(v, 60)}, expected a float or None"
        v = float(v)
        if not math.isfinite(v):
            return f"returned {v} (not finite)"
        return v

    @staticmethod
    def _message(f: _Fn, fails: dict, note: str, prompts, completions, n: int) -> str:
        i = min(fails)
        kinds = sorted(set(fails.values()), key=list(fails.values()).index)
        more = f" (and {len(kinds) - 1} other error(s))" if len(kinds) > 1 else ""
        msg = (f"reward {f.name!r} failed on {len(fails)} of {n} samples, which are masked: {kinds[0]}{more}. "
               f"First failed sample #{i}: prompt={_short(prompts[i])} completion={_short(completions[i])}")
        return msg + (f" ({note})" if note else "")

    def _track(self, f: _Fn, step, all_failed: bool, fails: dict, note: str) -> None:
        if not all_failed:
            f.streak, f.streak_step = 0, None
            return
        if f.streak_step == step:
            return  # another batch of the same step (dynamic sampling, evaluation)
        if f.streak == 0:
            first = fails[min(fails)]
            f.streak_error = f"{first} ({note})" if note else first
        f.streak, f.streak_step = f.streak + 1, step
        if self.max_failed_steps and f.streak >= self.max_failed_steps:
            raise RewardsFailed(f.name, f.streak, f.streak_error)
