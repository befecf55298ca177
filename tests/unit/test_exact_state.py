"""Exact mode is the model's (`Qwen3.exact`), never the process's: no module of src/rlcu keeps
exact-mode state of its own (a source check), and the model's flag takes only a bool. That two
models of one process compute each in its own mode is tests/integration/test_exact.py's."""

import ast
from pathlib import Path

import pytest
import torch

from rlcu import Qwen3
from rlcu.model.config import Qwen3Config

SRC = Path(__file__).resolve().parents[2] / "src" / "rlcu"
_IMMUTABLE = (ast.Constant, ast.Tuple, ast.Lambda)  # tuples: of constants, checked below


def _immutable(v: ast.AST) -> bool:
    if isinstance(v, ast.Tuple):
        return all(_immutable(e) for e in v.elts)
    return isinstance(v, _IMMUTABLE)


def _top_level(body: list) -> list:
    """The statements that run at import (or a class body's definition): a module's or a class's
    own, and those under its if / try / with blocks; not function bodies, nor a class's annotated
    fields (a dataclass's, each instance's own)."""
    out = []
    for st in body:
        out.append(st)
        if isinstance(st, ast.ClassDef):
            out += [s for s in _top_level(st.body) if not isinstance(s, ast.AnnAssign)]
        for field in ("body", "orelse", "finalbody"):
            if not isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out += _top_level(getattr(st, field, []))
        for h in getattr(st, "handlers", []):
            out += _top_level(h.body)
    return out


def _walk_no_defs(node: ast.AST):
    """ast.walk, not into function bodies (they run when called, not at import)."""
    yield node
    for c in ast.iter_child_nodes(node):
        if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _walk_no_defs(c)


def _targets(st: ast.stmt) -> list[str]:
    ts = st.targets if isinstance(st, ast.Assign) else [st.target]
    return [n.id for t in ts for n in ast.walk(t) if isinstance(n, ast.Name)]


def _problems(path: Path, src: Path = SRC) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    rel, out = path.relative_to(src.parent).as_posix(), []
    for st in _top_level(tree.body):
        if isinstance(st, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and st.value is not None:
            names = _targets(st)
            state = rel == "rlcu/ops/exact.py" or any("exact" in n.lower() for n in names)
            if state and not _immutable(st.value):
                out.append(f"{rel}:{st.lineno}: module-level state {', '.join(names)}")
        if not isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if any(isinstance(n, ast.Constant) and n.value == "RLCU_EXACT" for n in _walk_no_defs(st)):
                out.append(f"{rel}:{st.lineno}: RLCU_EXACT read at import")
    for n in ast.walk(tree):
        if isinstance(n, (ast.Global, ast.Nonlocal)) and any("exact" in x.lower() for x in n.names):
            out.append(f"{rel}:{n.lineno}: {type(n).__name__.lower()} {', '.join(n.names)}")
        name = getattr(n, "name", None) or getattr(n, "id", None) or getattr(n, "attr", None)
        if name in ("set_exact", "is_exact"):
            out.append(f"{rel}:{n.lineno}: {name}, the process-wide switch")
    return out


def test_no_module_keeps_exact_mode_state():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 50 and SRC / "ops" / "exact.py" in files
    problems = [p for f in files for p in _problems(f)]
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_process_wide_switch(tmp_path):
    """What the module held before exact mode moved onto the model is found, each part."""
    fake = tmp_path / "rlcu" / "ops" / "exact.py"
    fake.parent.mkdir(parents=True)
    fake.write_text('import os\n_STATE = {"on": os.environ.get("RLCU_EXACT", "") == "1"}\n\n\n'
                    'def set_exact(on=True):\n    _STATE["on"] = on\n\n\n'
                    'def is_exact():\n    global _EXACT\n    return _STATE["on"]\n\n\n'
                    'EXACT_MODES = ["on"]\nSIZES = {"a": 1}\nNAME = ("exact", 1)\n')
    got = _problems(fake, tmp_path / "rlcu")
    for want in (":2: module-level state _STATE", ":2: RLCU_EXACT read at import", "set_exact, the process",
                 "is_exact, the process", "global _EXACT", ":14: module-level state EXACT_MODES",
                 ":15: module-level state SIZES"):
        assert any(want in g for g in got), (want, got)
    assert not any(":16:" in g for g in got)  # an immutable tuple is no state


def test_exact_is_a_bool_of_the_model():
    cfg = Qwen3Config(vocab_size=11, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=4, max_position_embeddings=16)
    m = Qwen3.from_config(cfg)
    assert m.exact is False and Qwen3.from_config(cfg, exact=True).exact is True
    assert Qwen3(cfg, m.flat, exact=True).exact and not m.exact  # one model's mode is not another's
    m.exact = True
    assert m.exact
    with pytest.raises(TypeError, match="exact must be True or False, got 1"):
        m.exact = 1
    with pytest.raises(TypeError, match="got 'yes'"):
        Qwen3(cfg, torch.zeros_like(m.flat), exact="yes")
