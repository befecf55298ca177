"""Loading a config: a YAML file plus `--set a.b=c` overrides (values parsed as YAML) into a
config class, errors naming the dotted key and where its value came from; back to plain data
and YAML; `config_help`, the option list `--help` prints (the documentation site renders the
same fields, docs/gen/config_reference.py); `command_config`, what every command that takes
a config does with its arguments."""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

from rlcu.config.fields import _MISSING, ConfigError, Section, _build, _is_union, _unknown, field_types


def _set_path(data: dict, cls, dotted: str, value, source: str) -> None:
    """data[a][b] = value for dotted 'a.b', walking the fields of `cls` (unknown keys error;
    inside a dict-typed field any key is accepted)."""
    keys = dotted.split(".")
    d, c, prefix = data, cls, ""
    for i, k in enumerate(keys):
        last = i == len(keys) - 1
        if c is not None:
            names = {f.name: f for f in dataclasses.fields(c)}
            if k not in names:
                raise _unknown(k, c, prefix, source)
            tp = field_types(c)[k]
            sub = [a for a in ((tp,) if not _is_union(tp) else typing.get_args(tp))
                   if isinstance(a, type) and issubclass(a, Section)]
            nxt = sub[0] if sub else None
        else:
            nxt = None
        if last:
            d[k] = value
            return
        if not isinstance(d.get(k), dict):
            if c is not None and nxt is None and not _is_dict_type(field_types(c)[k]):
                raise ConfigError(f"{prefix}.{k}" if prefix else k, "is not a section; cannot set "
                                  f"{dotted!r}", source)
            d[k] = {}
        d, c, prefix = d[k], nxt, f"{prefix}.{k}" if prefix else k


def _is_dict_type(tp) -> bool:
    args = typing.get_args(tp) if _is_union(tp) else (tp,)
    return any(a is dict or typing.get_origin(a) is dict for a in args)


def parse_override(s: str) -> tuple[str, Any]:
    """'a.b=c' -> ('a.b', yaml-parsed c)."""
    if "=" not in s:
        raise ConfigError("", f"override {s!r} must look like key.path=value")
    k, v = s.split("=", 1)
    k = k.strip()
    if not k:
        raise ConfigError("", f"override {s!r} has an empty key")
    try:
        val = yaml.safe_load(v) if v.strip() else None
    except yaml.YAMLError:
        val = v
    return k, val


def load_config(cls, path: str | Path | None = None, overrides: list[str] | None = None):
    """Build `cls` from a YAML file (or nothing: the defaults) plus `--set key.path=value`
    overrides (values parsed as YAML). Unknown keys and bad values raise ConfigError naming
    the dotted key and where it came from."""
    data: dict = {}
    src = None
    if path is not None:
        src = str(path)
        try:
            text = Path(path).read_text()
        except FileNotFoundError:
            raise FileNotFoundError(f"config file {path} not found") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}" if mark else str(path)
            raise ConfigError("", f"{where}: invalid YAML: {getattr(e, 'problem', e)}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError("", f"{path}: the top level must be a mapping of options, got {type(data).__name__}")
    for s in overrides or []:
        k, v = parse_override(s)
        _set_path(data, cls, k, v, f"--set {s}")
    try:
        return _build(cls, data, "")
    except ConfigError as e:
        # name where the bad value came from: the override that set it, else the file
        for s in reversed(overrides or []):
            k = s.split("=", 1)[0].strip()
            if e.path == k or e.path.startswith(k + ".") or e.path.startswith(k + "["):
                raise ConfigError(e.path, e.detail, f"--set {s}") from None
        raise ConfigError(e.path, e.detail, e.source or src) from None


def config_from_dict(cls, data: dict, source: str | None = None):
    """cls built from plain data (e.g. parsed YAML), with the same checks and errors as load_config."""
    return _build(cls, data, "", source)


def config_to_dict(cfg) -> dict:
    """The config as plain YAML-able data (tuples become lists)."""
    def conv(x):
        if isinstance(x, Section):
            return {f.name: conv(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, (list, tuple)):
            return [conv(v) for v in x]
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        return x
    return conv(cfg)


def save_config(cfg, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def default_text(f) -> str:
    if f.default is not _MISSING:
        d = f.default
    elif f.default_factory is not _MISSING:
        d = f.default_factory()
        if isinstance(d, Section):
            return ""
    else:
        return "(required)"
    if isinstance(d, tuple):
        d = list(d)
    return yaml.safe_dump(d, default_flow_style=True).strip().removesuffix("...").strip()


def config_help(cls) -> str:
    """Every option of `cls` as 'dotted.name = default  help [choices]', sections first-level
    headed by their help."""
    lines: list[str] = []

    def walk(c, prefix: str):
        hints = field_types(c)
        leaf, subs = [], []
        for f in dataclasses.fields(c):
            tp = hints[f.name]
            if isinstance(tp, type) and issubclass(tp, Section):
                subs.append((f, tp))
            else:
                leaf.append(f)
        for f in leaf:
            name = f"{prefix}{f.name}"
            md = f.metadata
            extra = []
            if md.get("choices"):
                extra.append("one of: " + ", ".join(str(x) for x in md["choices"]))
            for key, word in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
                if md.get(key) is not None:
                    extra.append(f"{word} {md[key]}")
            doc = md.get("help", "") + (f" [{'; '.join(extra)}]" if extra else "")
            lines.append(f"  {name} = {default_text(f)}")
            lines.append(f"      {doc}")
        for f, tp in subs:
            lines.append(f"{prefix}{f.name}: {f.metadata.get('help', '')}")
            walk(tp, f"{prefix}{f.name}.")

    lines.append(f"{cls.__name__} options (YAML keys; override with --set key=value):")
    walk(cls, "")
    return "\n".join(lines)


def command_config(cls, parser, args, overrides: list[str], say=None):
    """A command's config from its YAML file (`args.config`) and `overrides`, or the command's
    exit status: 0 after `--help` (the parser's help, then every option of `cls`), 2 after a
    bad option or a missing file, said in one line `PROG: why` (say: the printer, e.g. once
    for all ranks; default stderr)."""
    if args.help:
        parser.print_help()
        print()
        print(config_help(cls))
        return 0
    try:
        return load_config(cls, args.config, overrides)
    except (ConfigError, FileNotFoundError) as e:
        line = f"{parser.prog}: {e}"
        if say is None:
            print(line, file=sys.stderr)
        else:
            say(line)
        return 2
