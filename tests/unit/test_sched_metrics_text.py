"""`rlcu sched metrics` as a person reads it: the service's start as a date and time (not a raw
epoch), durations and fractions in their units; --json keeps the numbers."""

import json
import time
import types

from rlcu.sched import cli

T0 = 1_790_000_000.25
METRICS = {"ok": True, "gpu_idle_frac": 0.125, "jobs_per_hour": 3.5, "mean_latency_s": 420.0, "jobs_done": 2,
           "mem_used_frac": 0.5, "mem_peak": [0.75, 0.5], "frag": 0.0, "t0": T0, "uptime_s": 7300.0}


def _run(monkeypatch, capsys, *extra) -> str:
    stub = types.SimpleNamespace(metrics=lambda: dict(METRICS))
    monkeypatch.setattr(cli, "_client", lambda a: stub)
    assert cli.main(["sched", "metrics", *extra]) == 0
    return capsys.readouterr().out


def test_metrics_text_has_no_raw_epoch(monkeypatch, capsys):
    out = _run(monkeypatch, capsys)
    lines = dict(line.split(None, 1) for line in out.splitlines())
    assert str(int(T0)) not in out
    assert lines["t0"] == time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(T0))
    assert lines["uptime_s"] == "2.0h" and lines["mean_latency_s"] == "7.0m"
    assert lines["gpu_idle_frac"] == "12.5%" and lines["mem_peak"] == "0.75, 0.50"
    assert "ok" not in lines


def test_metrics_json_keeps_the_numbers(monkeypatch, capsys):
    assert json.loads(_run(monkeypatch, capsys, "--json"))["t0"] == T0
