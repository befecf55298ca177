"""The exceptions and exit statuses that several packages share, at the bottom of the layers so
that each raises or catches them without importing the others: the trainers and the
scheduler's job raise SetupError, the flat and the sharded optimizer raise NonFiniteError and
the trainer core catches it, and `rlcu generate` exits with the trainers' status for a full
disk. What one package alone raises stays with it."""

from __future__ import annotations

import errno

NO_SPACE_STATUS = 74  # sysexits.h's EX_IOERR: the disk (or quota) filled up mid-run


def no_space(e: BaseException) -> bool:
    """Whether `e` is a full disk or quota (the errors NO_SPACE_STATUS stands for)."""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


class SetupError(Exception):
    """A run that cannot start as asked (a used run folder, a checkpoint that does not fit):
    one line for the user; the command line exits with status 2."""


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row with a non-finite loss or gradient norm. `info` holds
    the last step's metrics."""

    def __init__(self, msg: str, info: dict):
        super().__init__(msg)
        self.info = info
