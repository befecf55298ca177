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
