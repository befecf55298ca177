"""The command-line reference page, rendered at build time from the commands themselves.

Each block is what `rlcu ... --help` prints, captured by running the command's own `main`
with `--help` in this process at a fixed width, so the page is the parsers' text and cannot
drift from them. The trainers' and the demo's `--help` end with every config option; the page
cuts that part and links to the configuration reference, which renders the same fields.
"""

from __future__ import annotations

import contextlib
import io
import os

from rlcu.cli import COMMANDS
from rlcu.cli import main as rlcu_main
from rlcu.sched.cli import SUBCOMMANDS

WIDTH = "100"  # argparse wraps to $COLUMNS


def help_text(argv: list[str]) -> str:
    """What `rlcu ARGV` prints (argv ends with --help), at a fixed width."""
    buf = io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
            rlcu_main(argv)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return _cut_config_options(buf.getvalue()).rstrip()


def _cut_config_options(text: str) -> str:
    """The argparse part of a trainer's help: the config list that follows it is the
    configuration reference's."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.endswith("options (YAML keys; override with --set key=value):"):
            return "\n".join(lines[:i]).rstrip() + "\n\n(then every config option: see the configuration reference)"
    return text


def _block(title: str, argv: list[str], anchor: str) -> list[str]:
    return [f"## `{title}` {{#{anchor}}}", "", "```text", help_text(argv), "```", ""]


def render_cli_reference() -> str:
    """The Markdown body of the command-line reference."""
    out = ["## `rlcu` {#rlcu}", "", "```text", help_text(["--help"]), "```", ""]
    for cmd in COMMANDS:
        if cmd == "sched":
            out += _block("rlcu sched", ["sched", "--help"], "rlcu-sched")
            for sub in SUBCOMMANDS:
                out += _block(f"rlcu sched {sub}", ["sched", sub, "--help"], f"rlcu-sched-{sub}")
        else:
            out += _block(f"rlcu {cmd}", [cmd, "--help"], f"rlcu-{cmd}")
    return "\n".join(out)


def commands() -> list[str]:
    """Every command line the page documents (what a test checks it covers)."""
    names = [f"rlcu {c}" for c in COMMANDS if c != "sched"]
    return names + ["rlcu sched"] + [f"rlcu sched {s}" for s in SUBCOMMANDS]
