"""The scheduler's one-way layers (issue 13): protocol <- client <- services (socket
server, Ray actor) <- jobs, checked on the source, function-local imports included (they
once held a circle of client, job and ray_backend together)."""

import ast
from pathlib import Path

import rlcu.sched

SCHED = Path(rlcu.sched.__file__).parent
LOGIC = {"core", "ops", "views", "policy", "pool", "store", "metrics", "simulator", "rows", "audit", "load",
         "journal", "recovery"}  # the transport-free service logic
ALLOWED = {  # module -> the rlcu.sched modules it may import
    "protocol": set(),
    "auth": {"protocol"},
    "transport": {"protocol", "auth"},
    "client": {"protocol", "auth", "transport"},
    "service": {"protocol", "auth"},
    "conns": {"protocol", "auth", "service"},
    "server": {"protocol", "auth", "service", "conns"},
    "ray_backend": {"protocol", "auth", "transport", "client", "service"} | LOGIC,
    "lease": {"protocol", "auth", "client", "transport"},
    "hooks": {"protocol", "auth", "client", "transport", "lease"},
    "dp": {"protocol", "auth", "client", "transport", "lease", "hooks"},
    "job": {"protocol", "auth", "client", "transport", "dp", "lease", "hooks"},
    "ray_launch": {"protocol", "auth", "client", "transport", "job"},
    **{m: LOGIC for m in LOGIC},
}


def imports(mod: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse((SCHED / f"{mod}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return out


def test_sched_layers_are_one_way():
    for mod, allowed in ALLOWED.items():
        got = {m.split(".")[2] for m in imports(mod) if m.startswith("rlcu.sched.") and m.count(".") >= 2}
        got = {m for m in got if (SCHED / f"{m}.py").exists()}
        assert got <= allowed, f"rlcu.sched.{mod} imports {sorted(got - allowed)}: the layers are one-way"


def test_sched_uses_no_private_name_of_train():
    for mod in sorted(ALLOWED):
        bad = [m for m in imports(mod) if m.startswith("rlcu.train") and any(p.startswith("_") for p in m.split("."))]
        assert not bad, f"rlcu.sched.{mod} reaches into rlcu.train through {bad}"
