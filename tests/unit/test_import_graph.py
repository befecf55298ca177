"""The library's one-way layers (issue 33), checked on the source: every import of a module of
src/rlcu, at module level or inside a function (where imports once hid circles of train,
parallel and sched), relative ones resolved, and the names a module hands to
`importlib.import_module` (a literal, or the strings of a lazy face's map), goes to the
module's own layer or a lower one; inside rlcu.sched, to its own tier or a lower one; and no
modules import each other in a circle. There is no exception list: a new top-level module or
package of rlcu (or of rlcu.sched) fails until it is placed in the map below."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# lowest first; a module may import its own layer and the layers below it
LAYERS = [
    ("base", {"files", "threads", "hub", "config_hints", "errors", "timed"}),
    ("ops", {"ops"}),
    ("model", {"model"}),
    ("data, rewards, tools", {"data", "rewards", "tools"}),
    ("config", {"config"}),
    ("optim", {"optim"}),  # the flat AdamW the trainers and the ZeRO optimizer share
    ("memory", {"memory"}),
    ("engine", {"engine"}),
    ("parallel", {"parallel"}),  # imports nothing of train
    ("train", {"train"}),
    ("sched", {"sched"}),
    ("face", {"cli", "__main__", "__init__"}),  # __init__: the package rlcu itself
]
# a package's own finer order, lowest first (DESIGN: protocol <- client <- services <- jobs)
TIERS = {
    "sched": [
        ("logic", {"journal", "pool", "metrics", "rows", "store", "views", "load", "audit", "policy", "recovery",
                   "ops", "core", "simulator"}),  # the service's logic, free of messages and transports
        ("protocol", {"protocol", "auth"}),
        ("client", {"transport", "client"}),
        ("services", {"service", "conns", "server", "ray_backend", "dashboard"}),
        ("leases", {"lease", "hooks"}),  # the one lease holder, and the trainer's hooks on it
        ("jobs", {"dp", "job", "host", "join", "ray_launch", "integrations"}),
        ("face", {"cli", "__init__"}),
    ],
}


def module_files() -> dict[str, Path]:
    """'rlcu.x.y' -> its file; a package is named by its __init__.py."""
    out = {}
    for f in sorted((SRC / "rlcu").rglob("*.py")):
        parts = f.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _resolve(name: str, modules) -> str | None:
    """The module an import of `name` loads last: `name` itself, else its longest prefix that is one."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(mod: str, path: Path, modules) -> set[tuple[str, int]]:
    """(imported rlcu module, line) of every import statement in `mod`, wherever it stands, and
    of the strings naming rlcu modules when `mod` calls import_module."""
    tree = ast.parse(path.read_text(), str(path))
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out, dynamic, names = set(), False, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {(_resolve(a.name, modules), node.lineno) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:  # `from rlcu.x import y`: the module y when it is one, else rlcu.x
                out.add((f"{base}.{a.name}" if f"{base}.{a.name}" in modules else _resolve(base, modules),
                         node.lineno))
        elif isinstance(node, ast.Call):
            f = node.func
            dynamic |= (isinstance(f, ast.Attribute) and f.attr == "import_module") or \
                (isinstance(f, ast.Name) and f.id in ("import_module", "__import__"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.append((node.value, node.lineno))
    if dynamic:  # importlib.import_module("rlcu.x"), or of a map of such names (the lazy faces)
        out |= {(s, line) for s, line in names if s in modules}
    return {(m, line) for m, line in out if m is not None and m.split(".")[0] == "rlcu"}


def graph() -> dict[str, set[tuple[str, int]]]:
    modules = module_files()
    return {m: imports_of(m, f, modules) for m, f in modules.items()}


def _place(mod: str, package: str, order) -> int:
    """The index in `order` of the entry that names mod's first component below `package`."""
    head = mod[len(package) + 1:].split(".")[0] if mod != package else "__init__"
    for i, (_, names) in enumerate(order):
        if head in names:
            return i
    raise AssertionError(f"{mod} is in no layer of {package}: place {head!r} in test_import_graph's map")


def unplaced() -> list[str]:
    """The modules of src/rlcu that the map (or their package's tiers) does not place."""
    out = []
    for mod in module_files():
        places = [("rlcu", LAYERS)] + [(f"rlcu.{pkg}", tiers) for pkg, tiers in TIERS.items()
                                       if mod == f"rlcu.{pkg}" or mod.startswith(f"rlcu.{pkg}.")]
        for package, order in places:
            try:
                _place(mod, package, order)
            except AssertionError as e:
                out.append(str(e))
    return out


def test_every_module_has_a_layer():
    missing = unplaced()
    assert missing == [], "\n".join(missing)


def upward_imports(g) -> list[str]:
    bad = []
    for mod, deps in sorted(g.items()):
        for dep, line in sorted(deps):
            a, b = _place(mod, "rlcu", LAYERS), _place(dep, "rlcu", LAYERS)
            if b > a:
                bad.append(f"{mod}:{line} imports {dep} ({LAYERS[a][0]} -> {LAYERS[b][0]})")
            for pkg, tiers in TIERS.items():
                p = f"rlcu.{pkg}"
                if all(m == p or m.startswith(p + ".") for m in (mod, dep)):
                    a, b = _place(mod, p, tiers), _place(dep, p, tiers)
                    if b > a:
                        bad.append(f"{mod}:{line} imports {dep} ({pkg}: {tiers[a][0]} -> {tiers[b][0]})")
    return bad


def circles(g) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    edges = {m: sorted({d for d, _ in deps if d != m}) for m, deps in g.items()}
    index, low, stack, on, out = {}, {}, [], set(), []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on.add(v)
            if i < len(edges[v]):
                work.append((v, i + 1))
                w = edges[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                u = work[-1][0]
                low[u] = min(low[u], low[v])
    return out


def test_imports_go_down_the_layers():
    bad = upward_imports(graph())
    assert not bad, "imports up a layer:\n" + "\n".join(bad)


def test_no_circle_of_modules():
    found = circles(graph())
    assert not found, "modules that import each other in a circle:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_private_name_across_packages():
    """A module takes no private name (`_x`) out of another package's module (as parallel took
    train's `_STATE_DTYPES`): what packages share is public, or it lives below both."""
    modules, bad = module_files(), []
    for mod, f in modules.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlcu."):
                other = node.module.split(".")[1] != mod.split(".")[1] if mod.count(".") else True
                bad += [f"{mod}:{node.lineno} takes {node.module}.{a.name}" for a in node.names
                        if other and a.name.startswith("_") and f"{node.module}.{a.name}" not in modules]
    assert not bad, "\n".join(bad)


# the checker itself, on made-up graphs: it must see what it is there to see
def test_the_checks_see_an_upward_import_and_a_circle():
    g = {"rlcu.parallel.zero": {("rlcu.train.optimizer", 3)}, "rlcu.train.optimizer": set(),
         "rlcu.sched.client": {("rlcu.sched.job", 7)}, "rlcu.sched.job": {("rlcu.sched.client", 2)}}
    assert upward_imports(g) == ["rlcu.parallel.zero:3 imports rlcu.train.optimizer (parallel -> train)",
                                 "rlcu.sched.client:7 imports rlcu.sched.job (sched: client -> jobs)"]
    assert circles(g) == [["rlcu.sched.client", "rlcu.sched.job"]]


def test_the_parser_sees_hidden_and_relative_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import importlib\nfrom . import b\n\n\ndef f():\n    from ..train import core\n"
                 "    return importlib.import_module('rlcu.sched.job')\n")
    mods = {"rlcu", "rlcu.parallel", "rlcu.parallel.b", "rlcu.train", "rlcu.train.core", "rlcu.sched.job"}
    assert imports_of("rlcu.parallel.m", f, mods) == {("rlcu.parallel.b", 2), ("rlcu.train.core", 6),
                                                       ("rlcu.sched.job", 7)}
