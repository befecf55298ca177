"""Helpers of the scheduler core's tests: a settable clock and a call that must succeed."""

SPEC = {"c": {"devices": 1}}


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def ok(core, **msg):
    r = core.handle(msg)
    assert r["ok"], r
    return r
