"""examples/*.yaml: each loads; every value that differs from its dataclass default carries a
`default: X` mark in its line's comment (X the true default), and no value equal to its default
carries one; a file that says "Every option is listed" lists every option."""

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import yaml

from rlcu.config import Section, load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
_MARK = re.compile(r"(?:^|[(;,]\s*)default: (?P<x>.+?)\)?\s*$")


def _config_class(stem: str):
    if stem == "demo":
        from rlcu.config import DemoConfig

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
    hints = typing.get_type_hints(cls)
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


# ---------------------------------------------------------------- each example runs as shipped
# The Hub repositories the examples name, as the Hub holds them (the real data sets' splits and
# columns; the model is a tiny stand-in); the test builds them in a Hub cache of its own and runs
# offline. An example naming a repository not listed here fails: add the repository's real layout.
HUB_MODELS = ("Qwen/Qwen3-0.6B",)
HUB_DATASETS = {
    "trl-lib/DeepMath-103K": ("train", "test", "math"),  # prompt (chat messages), solution
    "trl-lib/Capybara": ("train", "test", "chat"),  # source, messages
    "trl-lib/ultrafeedback_binarized": ("train", "test", "preference"),  # chosen, rejected, score_*
}
# what makes a run of each example one short step of a tiny model on the CPU
TINY_RUN = {
    "sft": ["steps=1", "batch_tokens=256", "grad_accum=1", "optim.warmup_steps=0"],
    "dpo": ["steps=1", "batch_tokens=512", "grad_accum=1", "optim.warmup_steps=0", "data.eval_split=test",
            "eval_every=0"],
    "grpo": ["steps=1", "prompts_per_step=2", "group_size=2", "max_new_tokens=4", "overlong_buffer=2",
             "eval_every=0", "eval_max_prompts=2", "micro_batch_tokens=256", "dynamic_sampling_max_rounds=1"],
    "ppo": ["steps=1", "prompts_per_step=2", "max_new_tokens=4", "eval_every=0", "eval_max_prompts=2",
            "micro_batch_tokens=256"],
    "rm": ["steps=1", "batch_pairs=2", "batch_tokens=512", "optim.warmup_steps=0", "eval_every=0"],
    "demo": ["sft_steps=1", "grpo_steps=1", "task.n_train=32", "task.n_eval=4", "prompts_per_step=2",
             "group_size=2"],
}
_COMMON = ["log.tensorboard=false", "log.plot=false", "log.progress=false", "checkpoint.save_at_end=false",
           "checkpoint.every=0", "model.device=cpu"]


def _hub_for(cfg, hub):
    from support.hub_util import CHAT_ROWS, MATH_ROWS, PREFERENCE_ROWS, add_dataset, add_model

    critic = getattr(getattr(cfg, "critic", None), "path", None)
    for name in filter(None, [cfg.model.path, cfg.model.tokenizer, critic]):
        assert name in HUB_MODELS or Path(name).exists(), f"names model {name!r}: add it to HUB_MODELS"
        if name in HUB_MODELS:
            add_model(hub, name)
    for name in {cfg.data.path, cfg.data.eval_path} - {None}:
        assert name in HUB_DATASETS or Path(name).exists(), f"names data {name!r}: add its layout to HUB_DATASETS"
        if name in HUB_DATASETS:
            *splits, kind = HUB_DATASETS[name]
            rows = {"math": MATH_ROWS, "chat": CHAT_ROWS, "preference": PREFERENCE_ROWS}[kind]
            add_dataset(hub, name, dict.fromkeys(splits, rows))


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_runs_as_shipped(path, tmp_path, monkeypatch):
    """Each example, with only TINY_RUN's size overrides, takes a step: the Hub ids, splits, columns
    and reward options it names fit the repositories it names."""
    from support.hub_util import hub_env

    cmd = path.stem
    assert cmd in TINY_RUN, f"examples/{path.name}: add its short-run overrides to TINY_RUN"
    sets = TINY_RUN[cmd]
    if cmd == "demo":
        from rlcu.train.demo import main

        argv = ["demo", str(path), "--out", str(tmp_path / "run"), "--no-progress", "--set", "device=cpu"]
    else:
        pytest.importorskip("datasets")
        from rlcu.train.cli import main

        hub = hub_env(monkeypatch, tmp_path / "hf")
        _hub_for(load_config(_config_class(cmd), path), hub)
        sets = sets + _COMMON + [f"log.out_dir={tmp_path / 'run'}"]
        argv = [cmd, str(path)]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
