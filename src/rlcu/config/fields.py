"""Config fields: `opt`, `Section`, `ConfigError`, and the one coercion every field goes through.

Every option is a dataclass field made with `opt(default, help, ...)`: the help string,
the allowed values (`choices`) and numeric bounds (`gt`, `ge`, `lt`, `le`) live in the
field's metadata, so that one generic `__post_init__` coerces and checks every field and
`config_help` lists every option with its default. Sections nest (a field whose type is a
`Section` takes a section instance or a plain dict), and errors carry the dotted path of
the offending field, e.g. `optim.lr must be > 0, got -1 (in run.yaml)`.

YAML scalars are parsed by PyYAML (YAML 1.1), which reads `1e-4` as a string: float fields
accept such strings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import typing
from typing import Any

from rlcu.config_hints import hint, hint_text

_MISSING = dataclasses.MISSING


class ConfigError(ValueError):
    """A bad config value. `path` is the dotted field path, `detail` the complaint."""

    def __init__(self, path: str, detail: str, source: str | None = None):
        self.path, self.detail, self.source = path, detail, source
        super().__init__(str(self))

    def __str__(self) -> str:
        s = f"{self.path} {self.detail}" if self.path else self.detail
        return s + (f" (in {self.source})" if self.source else "")

    def under(self, prefix: str, source: str | None = None) -> ConfigError:
        path = f"{prefix}.{self.path}" if prefix and self.path else (prefix or self.path)
        return ConfigError(path, self.detail, self.source or source)


def opt(default: Any = _MISSING, help: str = "", *, choices: tuple | None = None, gt=None, ge=None,
        lt=None, le=None):
    """A documented config field. Mutable defaults (dict, list, a Section class) are
    wrapped in a default_factory."""
    md = dict(help=help, choices=choices, gt=gt, ge=ge, lt=lt, le=le)
    if isinstance(default, type) and issubclass(default, Section):
        return dataclasses.field(default_factory=default, metadata=md)
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda d=default: _copy(d), metadata=md)
    return dataclasses.field(default=default, metadata=md)


def _copy(x):
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_copy(v) for v in x]
    return x


# ---------------------------------------------------------------- type coercion
def field_types(cls) -> dict[str, Any]:
    """The type of each field of `cls`, each base's annotations read in its own module (a
    section that inherits fields need not import the types they name)."""
    return typing.get_type_hints(cls)


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def type_name(tp) -> str:
    if _is_union(tp):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    o = typing.get_origin(tp)
    if o is not None:
        return getattr(o, "__name__", str(o))
    return getattr(tp, "__name__", str(tp))


def _coerce(val, tp, name: str):
    """Return `val` converted to type `tp` or raise ConfigError(name, ...)."""
    if _is_union(tp):
        args = typing.get_args(tp)
        if val is None and type(None) in args:
            return None
        errs = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(val, a, name)
            except ConfigError as e:
                errs.append(e)
        raise ConfigError(name, f"must be {type_name(tp)}, got {val!r}")
    if tp is Any:
        return val
    if isinstance(tp, type) and issubclass(tp, Section):
        if isinstance(val, tp):
            return val
        if isinstance(val, dict):
            return _build(tp, val, name)
        raise ConfigError(name, f"must be a mapping of {tp.__name__} options, got {val!r}")
    if tp is bool:
        if isinstance(val, bool):
            return val
        if isinstance(val, str) and val.lower() in ("true", "false", "yes", "no", "on", "off"):
            return val.lower() in ("true", "yes", "on")
        raise ConfigError(name, f"must be true or false, got {val!r}")
    if tp is int or tp is float:
        return _number(val, tp, name)
    if tp is str:
        if isinstance(val, str):
            return val
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            return str(val)
        raise ConfigError(name, f"must be a string, got {val!r}")
    o, args = typing.get_origin(tp), typing.get_args(tp)
    if o is tuple:
        if not isinstance(val, (list, tuple)):
            raise ConfigError(name, f"must be a list of {len(args)} values, got {val!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(val))
        if len(val) != len(args):
            raise ConfigError(name, f"must have {len(args)} values, got {len(val)}: {list(val)!r}")
        return tuple(_coerce(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(val, args)))
    if o is list or tp is list:
        if not isinstance(val, (list, tuple)):
            raise ConfigError(name, f"must be a list, got {val!r}")
        a = args[0] if args else Any
        return [_coerce(v, a, f"{name}[{i}]") for i, v in enumerate(val)]
    if o is dict or tp is dict:
        if not isinstance(val, dict):
            raise ConfigError(name, f"must be a mapping, got {val!r}")
        return dict(val)
    if isinstance(tp, type) and isinstance(val, tp):
        return val
    raise ConfigError(name, f"must be {type_name(tp)}, got {val!r}")


def _number(val, tp, name: str):
    """An int or float field's value: a number (an int field takes a whole float, never a
    bool) or a string that parses as one (YAML 1.1 reads `1e-4` as a string)."""
    if isinstance(val, bool):
        pass
    elif isinstance(val, int) or (isinstance(val, float) and (tp is float or val.is_integer())):
        return tp(val)
    elif isinstance(val, str):
        with contextlib.suppress(ValueError):
            return tp(val)
    raise ConfigError(name, f"must be {'an integer' if tp is int else 'a number'}, got {val!r}")


def _check_bounds(val, md: dict, name: str) -> None:
    ch = md.get("choices")
    if ch is not None and val not in ch:
        raise ConfigError(name, f"must be one of {', '.join(repr(c) for c in ch)}; got {val!r}")
    if val is None or isinstance(val, bool) or not isinstance(val, (int, float)):
        return
    for key, ok, word in (("gt", lambda a, b: a > b, ">"), ("ge", lambda a, b: a >= b, ">="),
                          ("lt", lambda a, b: a < b, "<"), ("le", lambda a, b: a <= b, "<=")):
        b = md.get(key)
        if b is not None and not ok(val, b):
            raise ConfigError(name, f"must be {word} {b}, got {val!r}")


class Section:
    """Base of every config section: coerces and checks each field after __init__,
    then runs the section's own cross-field `check()`."""

    def __post_init__(self):
        hints = field_types(type(self))
        for f in dataclasses.fields(self):
            val = _coerce(getattr(self, f.name), hints[f.name], f.name)
            if isinstance(val, tuple) and f.metadata.get("choices") is None:
                for i, v in enumerate(val):
                    _check_bounds(v, f.metadata, f"{f.name}[{i}]")
            else:
                _check_bounds(val, f.metadata, f.name)
            object.__setattr__(self, f.name, val)
        self.check()

    def check(self) -> None:
        """Cross-field validation; raise ConfigError(field, detail)."""


def _build(cls, data: dict, prefix: str = "", source: str | None = None):
    """cls(**data) with unknown keys and bad values reported under `prefix`."""
    if not isinstance(data, dict):
        raise ConfigError(prefix, f"must be a mapping, got {data!r}", source)
    names = [f.name for f in dataclasses.fields(cls)]
    for k in data:
        if k not in names:
            raise _unknown(k, cls, prefix, source)
    try:
        return cls(**data)
    except ConfigError as e:
        raise e.under(prefix, source) from None


class UnknownOption(ConfigError):
    """A key that is no option of its section: `parent` is the section's dotted path, `found`
    where the key may belong (rlcu.config_hints: TRL's name of ours, or a near miss)."""

    def __init__(self, parent: str, key, names: list[str], found, source: str | None = None):
        self.parent, self.key, self.names, self.found = parent, key, list(names), found
        where = f"{parent}.{key}" if parent else str(key)
        super().__init__("", f"unknown option {where!r}{hint_text(str(key), found, parent)} "
                             f"(known: {', '.join(self.names)})", source)

    def under(self, prefix: str, source: str | None = None) -> ConfigError:
        parent = f"{prefix}.{self.parent}" if prefix and self.parent else (prefix or self.parent)
        return UnknownOption(parent, self.key, self.names, self.found, self.source or source)


def _unknown(key, cls, prefix, source) -> ConfigError:
    names = [f.name for f in dataclasses.fields(cls)]
    return UnknownOption(prefix, key, names, hint(str(key), names, _leaf_paths(cls)), source)


def _leaf_paths(cls) -> list[str]:
    """The dotted path of every option below `cls` that is not a section, shallowest first."""
    out, todo = [], [(cls, "")]
    while todo:
        c, prefix = todo.pop(0)
        for f in dataclasses.fields(c):
            tp = field_types(c)[f.name]
            if isinstance(tp, type) and issubclass(tp, Section):
                todo.append((tp, f"{prefix}{f.name}."))
            else:
                out.append(prefix + f.name)
    return out
