"""The state database's rows read back, every field checked against what the service writes.

A row that is not (JSON that does not parse, a device outside the pool, a list where a
mapping belongs, a number that is not finite) raises `StoreError` naming the file, the
table, the row and the column, and the start is refused with that one line; unchecked, it
surfaced deep in the policy as an IndexError or a bare "Expecting value".
"""

from __future__ import annotations

import json
import math

from rlcu.sched.metrics import Span
from rlcu.sched.pool import Request

FIX = "refusing to start on it (start with --fresh to move it aside and begin anew)"


class StoreError(ValueError):
    """The state file is not a usable scheduler database (the message says why and what to do)."""


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class Rows:
    """Decoders for one database file; `n_devices` (once the pool is known) bounds devices."""

    def __init__(self, path):
        self.path = path or "the in-memory database"
        self.n_devices: int | None = None

    def bad(self, table: str, row, column: str, why: str) -> StoreError:
        return StoreError(f"{self.path}: table {table}, row {row}, column {column}: {why}; {FIX}")

    def json(self, table: str, row, column: str, text):
        try:
            return json.loads(text)
        except (TypeError, ValueError) as e:
            raise self.bad(table, row, column, f"not valid JSON ({e})") from None

    def devices(self, table: str, row, column: str, devs) -> tuple[int, ...]:
        n = self.n_devices
        if not isinstance(devs, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in devs):
            raise self.bad(table, row, column, f"a list of device indices is expected, got {devs!r:.80}")
        out = [d for d in devs if d < 0 or (n is not None and d >= n)]
        if out:
            raise self.bad(table, row, column, f"device {out[0]} is outside the pool (devices 0..{(n or 1) - 1})")
        return tuple(devs)

    # ------------------------------------------------------------------ rows
    def meta(self, key: str, text):
        value = self.json("meta", f"key={key!r}", "value", text)
        if key == "pool":
            self._pool(value)
        elif key == "live" and (not isinstance(value, dict) or not isinstance(value.get("tally", {}), dict)
                                or not _num(value.get("next_id", 1)) or not _num(value.get("mtime", 0.0))):
            raise self.bad("meta", "key='live'", "value", "the metrics tally and next id are expected, "
                                                          f"got {text!r:.80}")
        return value

    def _pool(self, p) -> None:
        bad = lambda why: self.bad("meta", "key='pool'", "value", why)  # noqa: E731
        if not isinstance(p, dict) or not {"capacity", "names", "policy", "aging_s", "t0"} <= set(p):
            raise bad("a mapping of capacity, names, policy, aging_s, t0 is expected")
        cap, names = p["capacity"], p["names"]
        if not isinstance(cap, list) or not cap or not all(_num(c) and c > 0 for c in cap):
            raise bad(f"capacity must be a non-empty list of numbers > 0, got {cap!r:.80}")
        if not isinstance(names, list) or len(names) != len(cap) or not all(isinstance(x, str) for x in names):
            raise bad(f"names must be {len(cap)} device names, got {names!r:.80}")
        if not _num(p["aging_s"]) or not _num(p["t0"]) or not isinstance(p["policy"], str):
            raise bad("aging_s and t0 must be numbers, policy a name")

    def job(self, d: dict) -> dict:
        row = f"name={d['name']!r}"
        for col in ("clusters", "spec"):
            d[col] = self.json("jobs", row, col, d[col])
            if not isinstance(d[col], dict):
                raise self.bad("jobs", row, col, f"a mapping is expected, got {type(d[col]).__name__}")
        return d

    def request(self, table: str, row, column: str, text) -> Request | None:
        if text is None:
            return None
        d = self.json(table, row, column, text)
        try:
            d["only"] = self.devices(table, row, column + ".only", d["only"]) if d.get("only") is not None else None
            r = Request(**d)
        except (TypeError, KeyError, AttributeError) as e:
            raise self.bad(table, row, column, f"not a phase request ({type(e).__name__}: {e})") from None
        if not isinstance(r.id, int) or not isinstance(r.job, str) or not (r.mem is None or _num(r.mem)):
            raise self.bad(table, row, column, "not a phase request (id, job or mem of the wrong type)")
        return r

    def span(self, r: tuple) -> tuple[Span, Request | None, float | None]:
        """A `leases` row (id, job, phase, cluster, devices, mem, start, end, reason, yield_at, request)."""
        row = f"id={r[0]}"
        devs = self.devices("leases", row, "devices", self.json("leases", row, "devices", r[4]))
        mem = self.json("leases", row, "mem", r[5])
        if not isinstance(mem, list) or len(mem) != len(devs) or not all(_num(m) and m >= 0 for m in mem):
            raise self.bad("leases", row, "mem", f"{len(devs)} memory amounts >= 0 are expected, got {mem!r:.80}")
        if len(set(devs)) != len(devs):
            raise self.bad("leases", row, "devices", f"a device is named twice: {list(devs)}")
        if not _num(r[6]) or not (r[7] is None or _num(r[7])):
            raise self.bad("leases", row, "start/end", f"times must be numbers, got {r[6]!r}, {r[7]!r}")
        return (Span(r[0], r[1], r[2], r[3], devs, tuple(float(m) for m in mem), r[6], r[7], r[8]),
                self.request("leases", row, "request", r[10]), r[9])
