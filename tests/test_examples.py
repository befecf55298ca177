"""examples/*.yaml: each loads; every value that differs from its dataclass default carries a
`default: X` mark in its line's comment (X the true default), and no value equal to its default
carries one; a file that says "Every option is listed" lists every option."""

import dataclasses
import re
import sys
import typing
from pathlib import Path

import pytest
import yaml

from rlcu.config import Section, load_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
_MARK = re.compile(r"(?:^|[(;,]\s*)default: (?P<x>.+?)\)?\s*$")


def _config_class(stem: str):
    if stem == "demo":
        from rlcu.train.demo import DemoConfig

        return DemoConfig
    import importlib

    from rlcu.train.cli import COMMANDS

    assert stem in COMMANDS, f"examples/{stem}.yaml: no command of that name (map it to its config class here)"
    mod, cls = COMMANDS[stem][:2]
    return getattr(importlib.import_module(mod), cls)


def _leaves(cls, node, lines, prefix=""):
    """(dotted name, the value's YAML node or None when absent, the mark's text or None) of every
    option of `cls`, walking the YAML mapping `node` alongside."""
    items = {k.value: v for k, v in node.value} if isinstance(node, yaml.MappingNode) else {}
    hints = typing.get_type_hints(cls, globalns=vars(sys.modules[cls.__module__]))
    for f in dataclasses.fields(cls):
        tp, sub = hints[f.name], items.get(f.name)
        if isinstance(tp, type) and issubclass(tp, Section):
            yield from _leaves(tp, sub, lines, f"{prefix}{f.name}.")
            continue
        mark = None
        if sub is not None:
            rest = lines[sub.end_mark.line][sub.end_mark.column:]
            if "#" in rest:
                m = _MARK.search(rest.split("#", 1)[1].strip())
                mark = m.group("x") if m else None
        yield f"{prefix}{f.name}", sub, mark


def _get(cfg, dotted):
    for k in dotted.split("."):
        cfg = getattr(cfg, k)
    return cfg


def problems(path, cls) -> list[str]:
    text = path.read_text()
    cfg, default = load_config(cls, path), cls()
    listed_all = "Every option is listed" in text
    out = []
    for name, node, mark in _leaves(cls, yaml.compose(text), text.splitlines()):
        if node is None:
            if listed_all:
                out.append(f"{name}: missing (the file says every option is listed)")
            continue
        line = node.end_mark.line + 1
        want = _get(default, name)
        if _get(cfg, name) != want and mark is None:
            out.append(f"line {line}: {name} differs from its default {want!r} but is not marked '# default: ...'")
        elif mark is not None:
            said = _get(load_config(cls, None, [f"{name}={mark}"]), name)
            if _get(cfg, name) == want:
                out.append(f"line {line}: {name} is marked but equals its default")
            elif said != want:
                out.append(f"line {line}: {name} is marked 'default: {mark}' but the default is {want!r}")
    return out


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_marks_what_it_changes(path):
    found = problems(path, _config_class(path.stem))
    assert not found, f"{path.name}:\n  " + "\n  ".join(found)


def test_the_check_finds_each_kind_of_problem(tmp_path):
    from rlcu.config import SFTConfig

    f = tmp_path / "x.yaml"
    f.write_text("steps: 7\noptim:\n  lr: 1.0e-5  # default: 1.0e-5\n  warmup_steps: 3  # default: 9\n"
                 "log:\n  every: 2  # how often; default: 1\n")
    assert problems(f, SFTConfig) == [
        "line 3: optim.lr is marked but equals its default",
        "line 4: optim.warmup_steps is marked 'default: 9' but the default is 0",
        "line 1: steps differs from its default 100 but is not marked '# default: ...'"]
    f.write_text("# Every option is listed\nsteps: 7  # default: 100\n")
    found = problems(f, SFTConfig)
    assert "model.path: missing (the file says every option is listed)" in found
    assert not any(p.startswith("line ") for p in found)  # steps: marked, and rightly
