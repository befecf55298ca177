"""The run folder (log.out_dir) of a fresh run: it must not hold another run, whose
metrics.jsonl would be overwritten, whose TensorBoard events would mix with the new ones
and whose checkpoints a later `--resume auto` would take. A fresh run into a folder that
holds one is refused with one line unless log.overwrite (`--overwrite`) is set; then the
earlier run's files (those a run writes: metrics, logs, configs, events, plots and the
checkpoints under checkpoint.dir) are removed first, and nothing else in the folder.
checkpoint.resume: auto with no checkpoint to resume is a restart of a run killed before
its first checkpoint: its files are replaced."""

from __future__ import annotations

import shutil
from pathlib import Path

from rlcu.train.core import SetupError

RUN_FILES = ("metrics.jsonl", "config.yaml", "config.resume-step-*.yaml", "log.txt", "events.out.tfevents.*",
             "*_curve.png")


def _ckpt_dirs(ckpt_root: Path) -> list[Path]:
    if not ckpt_root.is_dir():
        return []
    return sorted(p for p in ckpt_root.iterdir() if p.is_dir() and (p.name.startswith("step-")
                                                                     or p.name.startswith(".tmp-")))


def earlier_run(out_dir: Path, ckpt_root: Path) -> list[Path]:
    """The files and checkpoint folders of a run already in out_dir / ckpt_root."""
    found = [p for pat in RUN_FILES for p in sorted(out_dir.glob(pat))] if out_dir.is_dir() else []
    return found + _ckpt_dirs(ckpt_root)


def claim(out_dir, ckpt_root, *, overwrite: bool, auto: bool = False) -> str:
    """Make out_dir ready for a fresh run (see the module docstring); returns a description of
    what was removed ('' if nothing)."""
    out_dir, ckpt_root = Path(out_dir), Path(ckpt_root)
    old = earlier_run(out_dir, ckpt_root)
    if not old:
        return ""
    has_run = any(p.name in ("metrics.jsonl", "config.yaml") or p.name.startswith("step-") for p in old)
    if has_run and not (overwrite or auto):
        names = ", ".join(str(p.relative_to(out_dir)) if p.is_relative_to(out_dir) else str(p) for p in old[:3])
        more = f" and {len(old) - 3} more" if len(old) > 3 else ""
        raise SetupError(f"log.out_dir {out_dir} already holds a run ({names}{more}): continue it with --resume auto "
                         f"(checkpoint.resume: auto), replace it with --overwrite (log.overwrite: true), or choose "
                         f"another log.out_dir")
    for p in old:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    n_ck = sum(1 for p in old if p.is_dir())
    return f"{len(old) - n_ck} files, {n_ck} checkpoints"
