"""The documentation site (docs/, mkdocs.yml): its generated pages cover the code, its nav
points at pages that exist, and the library's module docstrings carry no measured figures
(those live in bench/results and on the docs' benchmarks page, where they are dated by their
tree). The mkdocs build itself runs only where mkdocs is installed (the `docs` extra; CI)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import pkgutil
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _gen(name: str):
    """A generator module of docs/gen, imported as the mkdocs hooks import it."""
    sys.path.insert(0, str(DOCS / "gen"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(DOCS / "gen"))


def _nav_pages(nav) -> list[str]:
    out = []
    for item in nav:
        for value in (item.values() if isinstance(item, dict) else [item]):
            out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def _leaves(cls, prefix: str = "") -> list[str]:
    """Every option of a config dataclass as a dotted name, walked here apart from the
    generator so that the test does not trust its walk."""
    from rlcu.config import Section

    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and issubclass(tp, Section):
            out += _leaves(tp, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def test_config_reference_lists_every_option():
    ref = _gen("config_reference")
    text = ref.render_config_reference()
    missing = [(cmd, name) for cmd, cls in ref.COMMANDS for name in _leaves(cls) if f"| `{name}` |" not in text]
    assert not missing, f"options missing from the configuration reference: {missing}"


def test_config_reference_covers_every_config():
    """A new run config (a Section no other section holds) must be added to the reference."""
    import rlcu.config
    from rlcu.config import Section

    ref = _gen("config_reference")
    reachable = set()

    def walk(cls):
        reachable.add(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if isinstance(hints[f.name], type) and issubclass(hints[f.name], Section):
                walk(hints[f.name])

    for _, cls in ref.COMMANDS:
        walk(cls)
    mods = [importlib.import_module(f"rlcu.config.{m.name}") for m in pkgutil.iter_modules(rlcu.config.__path__)]
    configs = {c for m in mods for c in vars(m).values()
               if isinstance(c, type) and issubclass(c, Section) and c is not Section}
    bases = {b for c in reachable for b in c.__mro__[1:]}
    assert configs - reachable - bases == set()


def test_cli_reference_covers_every_command():
    cli = _gen("cli_reference")
    text = cli.render_cli_reference()
    for name in cli.commands():
        assert f"usage: {name}" in text, f"`{name} --help` missing from the command-line reference"
    assert "options (YAML keys" not in text  # the config lists belong to the configuration reference
    assert "Traceback" not in text


def test_nav_pages_exist_and_every_page_is_in_nav():
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = _nav_pages(cfg["nav"])
    missing = [p for p in pages if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml nav names pages that do not exist: {missing}"
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if not p.name.startswith("_")}
    assert on_disk - set(pages) == set(), "pages that the nav does not reach"


def test_benchmark_tables_render_from_existing_results():
    bench = _gen("bench_tables")
    used = set()
    for page in DOCS.rglob("*.md"):
        used |= set(re.findall(r"<!-- rlcu:bench ([a-z0-9-]+) -->", page.read_text()))
    assert used - set(bench.TABLES) == set(), "pages ask for tables that do not exist"
    for name in bench.TABLES:
        table = bench.render(name)
        assert table.startswith("| ") and "nan" not in table, name
        for cited in re.findall(r"`([\w.-]+\.json)`", table):
            assert (bench.RESULTS / cited).is_file(), f"{name} cites {cited}, not in bench/results"
    for image in bench.IMAGES:
        assert (bench.RESULTS / image).is_file()


TIMING = re.compile(r"\b\d+(\.\d+)?\s?(us|µs|ms)\b|tok/s|TFLOP/s|\bMFU\b|GB/s|TB/s|% of copy")


def test_module_docstrings_quote_no_measured_figures():
    """Timings go stale with the code; they belong in bench/results, rendered on the docs'
    benchmarks page with the tree they measured. A docstring says the design reason."""
    found = []
    for path in sorted((ROOT / "src" / "rlcu").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        found += [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for m in TIMING.finditer(doc)]
    assert not found, "module docstrings quoting measured figures: " + "; ".join(found)


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
    pytest.importorskip("material", reason="mkdocs-material is not installed (pip install -e '.[docs]')")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # material's banner about mkdocs 2
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()
    assert "rlcu:bench" not in (tmp_path / "site" / "benchmarks" / "index.html").read_text()
