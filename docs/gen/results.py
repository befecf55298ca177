"""What every benchmark table reads: a result file, its tree and device, and the table's Markdown."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def load(name: str) -> dict:
    with open(RESULTS / name) as f:
        return json.load(f)


def tree(name: str, data: dict | None = None) -> str:
    """The tree a result file measured: its meta.commit, else the commit that added it."""
    meta = (data if data is not None else load(name)).get("meta") or {}
    if meta.get("commit"):
        return f"`{meta['commit']}`"
    try:
        out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h", "-1", "--", str(RESULTS / name)],
                             cwd=RESULTS, capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    return f"added in `{out}` (the file names no tree)" if out else "not recorded in the file"


def device(data: dict) -> str:
    """The device a file names; a host-only benchmark (the scheduler service) names its cores."""
    found = (data.get("meta") or {}).get("device") or data.get("device")
    if found:
        return found
    return f"{data['cpus']} CPU cores" if data.get("cpus") else "device not recorded"


def source(name: str, data: dict | None = None) -> str:
    """'`file`, tree X, device' for a table's last column."""
    data = data if data is not None else load(name)
    return f"`{name}`, {tree(name, data)}, {device(data)}"


def _k(x: float) -> str:
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%" if x < 0.1 else f"{100 * x:.0f}%"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(lines)
