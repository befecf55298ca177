"""log.wandb in W&B's offline mode: the run's id is kept in out_dir and a resumed run continues
it from the step after the last one logged; the history is read back from the offline run files."""

import json
import re
import struct
import sys
import time

import pytest

from rlcu.config import LogConfig
from rlcu.train.logging import RunLogger


def _records(path):
    """The records of a W&B run file: a 7-byte header (':W&B', version), then LevelDB's log
    format (32 KiB blocks of chunks: crc32c u32, length u16, type u8: 1 full, 2 first, 3 middle,
    4 last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file (header {data[:7]!r})"
    i, part, out = 7, b"", []
    while i + 7 <= len(data):
        if 32768 - i % 32768 < 7:  # a block's tail too short for a chunk header is padding
            i += 32768 - i % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[i:i + 7])
        if kind == 0:
            break
        chunk, i = data[i + 7:i + 7 + n], i + 7 + n
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            out.append(part)
    return out


def _offline_run(path, rows: int = 0, timeout: float = 30.0):
    """(run id, [history rows]) of one offline run folder, read again until it holds `rows`
    history rows or `timeout` seconds pass: W&B's service process writes the file behind
    `finish()`, and on a loaded machine the records land late."""
    deadline = time.monotonic() + timeout
    while True:
        out = _read_offline_run(path)
        if len(out[1]) >= rows or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def _read_offline_run(path):
    from wandb.proto import wandb_internal_pb2 as pb

    (f,) = path.glob("run-*.wandb")
    run_id, rows = None, []
    for data in _records(f):
        r = pb.Record()
        r.ParseFromString(data)
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run_id = r.run.run_id
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_") or k == "_step"})
    return run_id, rows


@pytest.fixture
def offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    (tmp_path / "wandb_dir").mkdir()
    yield tmp_path / "wandb_dir" / "wandb"
    import wandb

    wandb.teardown()  # wandb keeps its settings (WANDB_DIR) for the process until then


def _run(out, steps, f, resume_step=None):
    cfg = LogConfig(progress=False, plot=False, tensorboard=False, wandb=True, wandb_project="rlcu-test")
    with RunLogger(out, cfg, total_steps=6, resume_step=resume_step, run_config={"steps": 6}) as log:
        for s in steps:
            log.log(s, {"loss": f(s), "reward/mean": 0.5})


def test_wandb_offline_resume_continues_the_run(tmp_path, offline):
    out = tmp_path / "run"
    _run(out, range(1, 6), float)  # steps 1-5, then killed; the checkpoint was at step 3
    run_id = (out / "wandb_run_id").read_text().strip()
    _run(out, range(4, 7), lambda s: 10.0 * s, resume_step=3)
    assert (out / "wandb_run_id").read_text().strip() == run_id
    runs = sorted(offline.glob("offline-run-*"))
    # wandb names a run's folder offline-run-<time>-<id>, with -1, -2, ... when a folder of that name
    # exists already (two runs within one second)
    name = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    assert len(runs) == 2 and all(name.fullmatch(p.name) for p in runs)
    (id1, rows1), (id2, rows2) = _offline_run(runs[0], 5), _offline_run(runs[1], 1)
    # the folder names carry the id (checked above); the run record itself may reach the file late on a
    # loaded machine, so it is checked where present
    assert {id1, id2} - {None} == {run_id}
    assert [(r["_step"], r["loss"]) for r in rows1] == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)]
    # W&B already has steps 4 and 5: the resumed process goes on from step 6
    assert [(r["_step"], r["loss"]) for r in rows2] == [(6, 60)]
    assert rows2[0]["reward/mean"] == 0.5
    _run(out, range(1, 2), float)  # a fresh run (no resume) is a new W&B run
    assert (out / "wandb_run_id").read_text().strip() != run_id


def test_wandb_turned_on_at_resume_gets_every_step(tmp_path, offline):
    out = tmp_path / "run"
    with RunLogger(out, LogConfig(progress=False, plot=False, tensorboard=False), total_steps=6) as log:
        for s in range(1, 6):
            log.log(s, {"loss": float(s)})
    _run(out, range(4, 7), lambda s: 10.0 * s, resume_step=3)  # no earlier W&B run: a new one, from step 4
    (run,) = offline.glob("offline-run-*")
    assert [(r["_step"], r["loss"]) for r in _offline_run(run, 3)[1]] == [(4, 40), (5, 50), (6, 60)]


def test_wandb_missing_names_the_field(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(RuntimeError, match=r"log\.wandb .*rlcu\[wandb\]"):
        _run(tmp_path, range(1, 2), float)
