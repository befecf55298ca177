"""Reward functions by name: a built-in (`math`, `format`) or 'module.path:function' (tools and
environment classes are found the same way, `load_object`).

A user's module is found as users expect without PYTHONPATH: beside the config file
(`add_import_dir`, which the CLI calls with the config's folder) and in the working
directory, before the rest of sys.path. A folder is put on sys.path only when it holds the
module's top-level file or package, so that nothing else in it can shadow a library.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

from rlcu.rewards.call import describe
from rlcu.rewards.format import format_reward
from rlcu.rewards.math import math_reward

BUILTIN = {"math": math_reward, "format": format_reward}
_DIRS: list[str] = []


def add_import_dir(path) -> None:
    """Look for reward modules in `path` (a folder, or a file: its folder) too."""
    if path is None:
        return
    p = Path(path).resolve()
    p = p if p.is_dir() else p.parent
    if str(p) not in _DIRS:
        _DIRS.append(str(p))


def _search_dirs() -> list[str]:
    return list(dict.fromkeys([*_DIRS, os.getcwd()]))  # a config in the working directory: once


def _where_looked() -> str:
    """The folders searched, each once with why (a config's folder, the working directory)."""
    why: dict[str, list[str]] = {}
    for d in _DIRS:
        why.setdefault(d, []).append("beside the config")
    why.setdefault(os.getcwd(), []).append("the working directory")
    return ", ".join(f"{d} ({' and '.join(w)})" for d, w in why.items()) + " and sys.path"


def _make_findable(mod_name: str) -> None:
    top = mod_name.split(".", 1)[0]
    for d in reversed(_search_dirs()):
        if (Path(d) / f"{top}.py").is_file() or (Path(d) / top).is_dir():
            if d in sys.path:
                sys.path.remove(d)
            sys.path.insert(0, d)
            importlib.invalidate_caches()


def load_reward(spec: str) -> Callable:
    """'math' | 'format' | 'module.path:function' -> the callable."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise ValueError(f"reward {spec!r}: expected a built-in ({', '.join(BUILTIN)}) or 'module.path:function'")
    return load_object(spec, "reward")


def load_object(spec: str, what: str, want_callable: bool = True):
    """'module.path:attr' -> the object (rewards, tools, environment classes), found as the
    module docstring says; errors are ValueErrors that start with `what` and the spec."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{what} {spec!r}: expected 'module.path:name'")
    mod_name, fn_name = spec.split(":", 1)
    _make_findable(mod_name)
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name and mod_name.startswith(e.name):
            raise ValueError(f"{what} {spec!r}: cannot import module {mod_name!r}: {e} (looked in "
                             f"{_where_looked()})") from None
        raise ValueError(f"{what} {spec!r}: cannot import module {mod_name!r}: {describe(e)}") from None
    except Exception as e:  # noqa: BLE001 - a syntax error or an exception in the user's module
        raise ValueError(f"{what} {spec!r}: importing module {mod_name!r} raised {describe(e)}") from None
    obj = mod
    for part in fn_name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: module {mod_name!r} has no attribute {fn_name!r}")
        obj = getattr(obj, part)
    if want_callable and not callable(obj):
        raise ValueError(f"{what} {spec!r}: {fn_name!r} is not callable")
    return obj


def reward_specs(reward_fns, cfg_specs: list[dict]) -> list[dict]:
    """reward_fns (Python API): None (use the config), one callable, or a list of callables,
    'module:function' strings, built-in names, spec dicts, reward models (a RewardModel, or the
    folder of one as a Path or a string naming a folder)."""
    if reward_fns is None:
        return cfg_specs
    if callable(reward_fns) or isinstance(reward_fns, (str, dict, Path)) or _is_model(reward_fns):
        reward_fns = [reward_fns]
    specs = []
    for r in reward_fns:
        if isinstance(r, dict):
            specs.append(r)
        elif _is_model(r) or isinstance(r, Path) or (isinstance(r, str) and Path(r).expanduser().is_dir()):
            specs.append({"model": r})
        elif isinstance(r, str):
            specs.append({"fn": r} if ":" in r else {"name": r})
        elif callable(r):
            specs.append({"fn": r})
        else:
            raise TypeError(f"a reward must be a callable, a 'module:function' string, a built-in name or a spec "
                            f"dict, got {r!r}")
    return specs


def _is_model(r) -> bool:
    """A reward model object: a RewardModel (score(sequences), cfg) or a ModelReward."""
    from rlcu.rewards.model_reward import ModelReward

    return isinstance(r, ModelReward) or (hasattr(r, "score") and hasattr(r, "cfg") and not callable(r))
