"""MkDocs hooks: the pages that are rendered from the code and from bench/results at build time.

A page holds a marker where generated Markdown goes (`<!-- rlcu:config-reference -->`,
`<!-- rlcu:cli-reference -->`, `<!-- rlcu:bench NAME -->`); `on_page_markdown` replaces it,
so the configuration and command-line references are the dataclasses' and parsers' own text
and the benchmark tables are the result files' figures. The figures' PNGs stay in
bench/results and are added to the site as files (`figures/NAME`), not copied into docs/.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent / "gen"))

import bench_tables  # noqa: E402
import cli_reference  # noqa: E402
import config_reference  # noqa: E402

MARKER = re.compile(r"<!-- rlcu:(config-reference|cli-reference|bench [a-z0-9-]+) -->")


def _generated(kind: str) -> str:
    if kind == "config-reference":
        return config_reference.render_config_reference()
    if kind == "cli-reference":
        return cli_reference.render_cli_reference()
    return bench_tables.render(kind.split(" ", 1)[1])


def on_page_markdown(markdown, page, config, files):
    return MARKER.sub(lambda m: _generated(m.group(1)), markdown)


def on_files(files, config):
    for name in bench_tables.IMAGES:
        src = bench_tables.RESULTS / name
        files.append(File.generated(config, f"figures/{name}", abs_src_path=str(src)))
    return files
