"""`Journal`, the dict type of the pool's books (pool.py): it notes which keys each change
touched, so that the audit after a change checks what changed (audit.py) rather than every
lease, request and job of the pool."""

from __future__ import annotations


class Journal(dict):
    """A dict that notes every key set or deleted since the last `take()` (the audit checks
    what changed, not everything). Past `LIMIT` keys (nobody takes them: the simulator) it
    notes only that too much changed, which `take()` answers with None (audit everything)."""

    __slots__ = ("touched",)
    LIMIT = 1 << 16

    def __init__(self):
        super().__init__()
        self.touched: set | None = set()

    def take(self) -> set | None:
        out, self.touched = self.touched, set()
        return out

    def _note(self, k) -> None:
        t = self.touched
        if t is not None:
            t.add(k)
            if len(t) > self.LIMIT:
                self.touched = None

    def __setitem__(self, k, v):
        self._note(k)
        super().__setitem__(k, v)

    def __delitem__(self, k):
        self._note(k)
        super().__delitem__(k)

    def pop(self, k, *default):
        self._note(k)
        return super().pop(k, *default)

    def popitem(self):
        k, v = super().popitem()
        self._note(k)
        return k, v

    def setdefault(self, k, v=None):
        if k not in self:
            self[k] = v
        return self[k]

    def update(self, *a, **kw):
        for k, v in dict(*a, **kw).items():
            self[k] = v

    def clear(self):
        for k in self:
            self._note(k)
        super().clear()

    def __ior__(self, other):
        self.update(other)
        return self
