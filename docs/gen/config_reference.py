"""The configuration reference page, rendered from the config dataclasses at build time.

Every option is a dataclass field made with `rlcu.config.opt`, whose metadata holds its help,
its allowed values and its bounds; this module walks those fields the way `config_help` does
(`rlcu grpo --help`), so the page and the command line cannot disagree, and a field added to
the code appears here at the next build. A section (model, optim, ...) shared by several
commands is rendered once, with the commands that take it.
"""

from __future__ import annotations

import dataclasses

from rlcu.config import (
    DemoConfig,
    DPOConfig,
    GRPOConfig,
    PPOConfig,
    RMConfig,
    Section,
    SFTConfig,
    default_text,
    field_types,
    type_name,
)

# (command, config class): the order of the page
COMMANDS = (("rlcu sft", SFTConfig), ("rlcu dpo", DPOConfig), ("rlcu grpo", GRPOConfig), ("rlcu ppo", PPOConfig),
            ("rlcu rm", RMConfig), ("rlcu demo", DemoConfig))


def _is_section(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, Section)


def _cell(text: str) -> str:
    """Text for a Markdown table cell: pipes escaped, line breaks folded."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _allowed(md) -> str:
    parts = []
    if md.get("choices"):
        parts.append("one of " + ", ".join(f"`{c}`" for c in md["choices"]))
    for key, word in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if md.get(key) is not None:
            parts.append(f"{word} {md[key]}")
    return "; ".join(parts)


def _row(prefix: str, f, tp) -> str:
    default = default_text(f)
    cells = [f"`{prefix}{f.name}`", _cell(type_name(tp)), f"`{_cell(default)}`" if default else "",
             _cell(_allowed(f.metadata)), _cell(f.metadata.get("help", ""))]
    return "| " + " | ".join(cells) + " |"


def _table(cls, prefix: str) -> tuple[list[str], list[tuple[str, type, str]]]:
    """The rows of `cls`'s leaf fields under `prefix`, and its sub-sections (dotted name,
    class, help) to render apart."""
    rows = ["| option | type | default | allowed | what it does |", "| --- | --- | --- | --- | --- |"]
    subs = []
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _is_section(tp):
            subs.append((f"{prefix}{f.name}", tp, f.metadata.get("help", "")))
        else:
            rows.append(_row(prefix, f, tp))
    return rows, subs


def _anchor(name: str) -> str:
    return "section-" + name.replace(".", "-")


def _sections() -> dict[tuple[str, type], tuple[str, list[str]]]:
    """(dotted name, class) -> (help, commands that take it), in first-seen order."""
    found: dict[tuple[str, type], tuple[str, list[str]]] = {}

    def walk(cls, prefix: str, cmd: str):
        _, subs = _table(cls, prefix)
        for name, sub, help_ in subs:
            key = (name, sub)
            if key not in found:
                found[key] = (help_, [])
            if cmd not in found[key][1]:
                found[key][1].append(cmd)
            walk(sub, name + ".", cmd)

    for cmd, cls in COMMANDS:
        walk(cls, "", cmd)
    return found


def render_config_reference() -> str:
    """The Markdown body of the configuration reference."""
    out: list[str] = []
    for cmd, cls in COMMANDS:
        rows, subs = _table(cls, "")
        out += [f"## `{cmd}` ({cls.__name__})", "", f"Top-level options of `{cmd} CONFIG.yaml`.", ""]
        out += rows
        if subs:
            links = ", ".join(f"[`{name}`](#{_anchor(name)})" for name, _, _ in subs)
            out += ["", f"Sections: {links}."]
        out.append("")
    out += ["## Sections", ""]
    for (name, cls), (help_, cmds) in _sections().items():
        rows, subs = _table(cls, name + ".")
        users = ", ".join(f"`{c}`" for c in cmds)
        out += [f"### `{name}` ({cls.__name__}) {{#{_anchor(name)}}}", "", f"{help_[:1].upper()}{help_[1:]}. "
                f"Used by {users}.", ""]
        out += rows
        if subs:
            out += ["", "Sub-sections: " + ", ".join(f"[`{n}`](#{_anchor(n)})" for n, _, _ in subs) + "."]
        out.append("")
    return "\n".join(out)


def leaf_options(cls, prefix: str = "") -> list[str]:
    """Every leaf option of `cls` as a dotted name (what the reference must show)."""
    names = []
    hints = field_types(cls)
    for f in dataclasses.fields(cls):
        if _is_section(hints[f.name]):
            names += leaf_options(hints[f.name], f"{prefix}{f.name}.")
        else:
            names.append(prefix + f.name)
    return names
