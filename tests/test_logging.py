"""RunLogger: metrics.jsonl, TensorBoard events parsed back (CRC-checked), resume
truncation, log.txt; the TFRecord / protobuf encoding against hand-computed bytes."""

import json
import struct

import pytest

from rlcu.config import LogConfig
from rlcu.train.logging import RunLogger
from rlcu.train.tb_writer import crc32c, encode_event, masked_crc, read_events, tfrecord


def test_crc32c_known_values():
    assert crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    c = crc32c(b"abc")
    assert masked_crc(b"abc") == ((((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def test_event_bytes_by_hand():
    ev = encode_event(1.5, 3, {"a": 2.0})
    want = (b"\x09" + struct.pack("<d", 1.5)  # field 1, fixed64: wall_time
            + b"\x10\x03"  # field 2, varint: step
            + b"\x2a\x0a"  # field 5, length 10: summary
            + b"\x0a\x08"  # Summary.value (field 1), length 8
            + b"\x0a\x01a"  # Value.tag = "a"
            + b"\x15" + struct.pack("<f", 2.0))  # Value.simple_value (field 2, fixed32)
    assert ev == want
    rec = tfrecord(ev)
    assert rec[:8] == struct.pack("<Q", len(ev)) and rec[12:-4] == ev
    assert struct.unpack("<I", rec[-4:])[0] == masked_crc(ev)
    assert encode_event(0.0, 300)[9:12] == b"\x10\xac\x02"  # a two-byte varint


def test_run_logger(tmp_path):
    cfg = LogConfig(every=2, progress=False, plot=True)
    with RunLogger(tmp_path, cfg, total_steps=5) as log:
        for s in range(1, 6):
            log.log(s, {"loss": 1.0 / s, "reward/mean": 0.1 * s, "note": "x", "skipped": False})
        log.info("hello")
        log.warn("careful")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 5]  # every 2 steps, and the last
    assert rows[0] == {"step": 2, "loss": 0.5, "reward/mean": 0.2, "note": "x", "skipped": 0}
    txt = (tmp_path / "log.txt").read_text()
    assert "INFO hello" in txt and "WARN careful" in txt
    files = list(tmp_path.glob("events.out.tfevents.*"))
    assert len(files) == 1
    evs = read_events(files[0])
    assert evs[0]["file_version"] == "brain.Event:2"
    got = {(e["step"], k): v for e in evs[1:] for k, v in e["scalars"].items()}
    assert got[(4, "loss")] == pytest.approx(0.25) and got[(5, "reward/mean")] == pytest.approx(0.5, rel=1e-6)
    assert set(k for _, k in got) == {"loss", "reward/mean", "skipped"}
    try:
        import matplotlib  # noqa: F401

        assert (tmp_path / "reward_curve.png").stat().st_size > 0
    except ImportError:
        assert "matplotlib is not installed" in txt


def test_tensorboard_reads_it(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with RunLogger(tmp_path, LogConfig(progress=False, plot=False), total_steps=3) as log:
        for s in range(1, 4):
            log.log(s, {"loss": float(s)})
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_resume_truncates(tmp_path):
    cfg = LogConfig(progress=True, plot=False, tensorboard=False)
    with RunLogger(tmp_path, cfg, total_steps=6) as log:
        for s in range(1, 6):
            log.log(s, {"loss": float(s)})
    with RunLogger(tmp_path, cfg, total_steps=6, resume_step=3) as log:
        assert [r["step"] for r in log.history] == [1, 2, 3]
        for s in range(4, 7):
            log.log(s, {"loss": 10.0 * s})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
    with RunLogger(tmp_path, cfg, total_steps=6):  # a fresh run starts a fresh file
        pass
    assert (tmp_path / "metrics.jsonl").read_text() == ""
