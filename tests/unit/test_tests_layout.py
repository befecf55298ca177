"""The tests folder's layout, read from the source: tests/unit and tests/integration hold test
files only (test_*.py), no two of them share a name (pytest imports each by its bare name), and
none takes anything from another test file, by an import or a "module:function" string: what
two files share lives in tests/support, which imports no test file either."""

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
KINDS = ("unit", "integration")
FN_REF = re.compile(r"^(test_\w+):\w+$")  # a reward or callable named as "module:function"


def _test_files():
    return sorted(p for kind in KINDS for p in (TESTS / kind).rglob("*.py"))


def _taken_from(path: Path) -> set[str]:
    """The test modules `path` imports (at any depth, in any function) or names in a string."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and FN_REF.match(node.value):
            out.add(FN_REF.match(node.value).group(1))
    return {m for m in out if m.startswith("test_")}


def test_unit_and_integration_hold_test_files_with_distinct_names():
    files = _test_files()
    assert len(files) > 50  # the walk found the folders
    assert [p.relative_to(TESTS).as_posix() for p in files if not p.name.startswith("test_")] == []
    assert [p.relative_to(TESTS).as_posix() for p in files if p.parent.name not in KINDS] == []
    names = [p.name for p in files]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_no_test_file_takes_from_another():
    files = _test_files() + sorted((TESTS / "support").glob("*.py")) + [TESTS / "conftest.py"]
    found = {p.relative_to(TESTS).as_posix(): sorted(_taken_from(p) - {p.stem}) for p in files}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_check_sees_every_kind_of_reference(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text("import test_a\nfrom test_b import c\n\n\ndef f():\n    from test_c.d import e\n"
                 "    return ['test_x:own', 'test_d:fn', 'support.trainers:fn', 'test_e: not a reference']\n")
    assert _taken_from(f) - {"test_x"} == {"test_a", "test_b", "test_c", "test_d"}
