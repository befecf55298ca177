"""`rlcu generate --help` shows every option's default (or what leaving it unset means)."""

import argparse

from rlcu.engine.cli import build_parser


def test_generate_help_shows_defaults():
    p = build_parser()
    text = " ".join(p.format_help().split())  # unwrapped
    for a in p._actions:
        if a.default is argparse.SUPPRESS or not a.option_strings:
            continue
        if a.default is None or a.default == "" or isinstance(a, argparse._StoreTrueAction):
            assert "unset" in (a.help or "") or a.default is False, f"{a.option_strings[0]}: no default shown"
        else:
            assert f"(default: {a.default})" in text, f"{a.option_strings[0]}: default {a.default!r} not shown"


def test_block_size_help_matches_the_engine():
    from rlcu.ops.paged_attention import DEFAULT_BLOCK_SIZE

    (a,) = [a for a in build_parser()._actions if "--block-size" in a.option_strings]
    assert f"(unset: {DEFAULT_BLOCK_SIZE})" in a.help


def test_output_piped_into_a_reader_that_goes_away_ends_quietly(tmp_path):
    """`rlcu grpo --help | head`: the reader is gone before the command writes, so every write
    fails with EPIPE; each command ends with status 141 (128 + SIGPIPE) and no traceback."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    trace = str(Path(__file__).resolve().parents[2] / "examples" / "sched_trace.json")
    # the trainers' help (the report), a command's plain output, and one through rlcu sched's
    # own error handling (BrokenPipeError is an OSError); every command goes through rlcu.cli.main
    cmds = [["grpo", "--help"], ["sft", "--print-config"], ["sched", "simulate", trace]]
    procs = []
    for c in cmds:  # all at once: each mostly waits on its imports
        p = subprocess.Popen([sys.executable, "-c", "import sys; from rlcu.cli import main; sys.exit(main())", *c],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path)
        p.stdout.close()  # the reader goes away before anything is written
        procs.append(p)
    for c, p in zip(cmds, procs):
        err = p.stderr.read().decode()
        rc = p.wait(timeout=120)
        p.stderr.close()
        assert rc == 141 and err == "", (c, rc, err[-2000:])


def test_readme_lists_every_command():
    import re
    from pathlib import Path

    from rlcu.cli import COMMANDS

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    line = re.search(r"`rlcu --help` lists the commands: ([^;]*);", readme)
    assert line, "README: the command list is gone"
    assert re.findall(r"`(\w+)`", line.group(1)) == list(COMMANDS)
