"""TensorBoard scalar event files, written (and read back) by hand: no tensorboard or
protobuf dependency.

An event file is a sequence of TFRecords:
    uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)
(little endian; masked(c) = ((c >> 15 | c << 17) + 0xa282ead8) mod 2^32), each holding one
serialized `Event` protobuf: wall_time (field 1, double), step (2, int64), file_version
(3, string, the first record: "brain.Event:2") and summary (5, Summary). A Summary is a
repeated field 1 of Value{tag (1, string), simple_value (2, float)}.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    poly = 0x82F63B78  # Castagnoli, reflected
    t = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        t.append(c)
    return t


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# ---------------------------------------------------------------- protobuf encoding
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _bytes_field(field: int, data: bytes) -> bytes:
    return _key(field, 2) + _varint(len(data)) + data


def encode_event(wall_time: float, step: int, scalars: dict[str, float] | None = None,
                 file_version: str | None = None) -> bytes:
    out = _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(int(step))
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        summ = b"".join(_bytes_field(1, _bytes_field(1, tag.encode()) + _key(2, 5) + struct.pack("<f", float(v)))
                        for tag, v in scalars.items())
        out += _bytes_field(5, summ)
    return out


def tfrecord(data: bytes) -> bytes:
    n = struct.pack("<Q", len(data))
    return n + struct.pack("<I", masked_crc(n)) + data + struct.pack("<I", masked_crc(data))


class EventWriter:
    """Appends scalar events to out_dir/events.out.tfevents.<time>.<host>.<pid>."""

    def __init__(self, out_dir):
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self._f = open(self.path, "ab")
        self._f.write(tfrecord(encode_event(time.time(), 0, file_version="brain.Event:2")))
        self._f.flush()

    def add_scalars(self, step: int, scalars: dict[str, float], wall_time: float | None = None) -> None:
        if scalars:
            self._f.write(tfrecord(encode_event(time.time() if wall_time is None else wall_time, step, scalars)))
            self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()


# ---------------------------------------------------------------- reading back
def _read_varint(b: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        x = b[i]
        i += 1
        n |= (x & 0x7F) << shift
        shift += 7
        if not x & 0x80:
            return n, i


def _fields(b: bytes):
    """Yield (field, wire, value) of one protobuf message (value: int, bytes or raw)."""
    i = 0
    while i < len(b):
        k, i = _read_varint(b, i)
        field, wire = k >> 3, k & 7
        if wire == 0:
            v, i = _read_varint(b, i)
        elif wire == 1:
            v, i = b[i:i + 8], i + 8
        elif wire == 5:
            v, i = b[i:i + 4], i + 4
        elif wire == 2:
            n, i = _read_varint(b, i)
            v, i = b[i:i + n], i + n
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield field, wire, v


def read_events(path) -> list[dict]:
    """Parse an event file (checking every CRC) into dicts with wall_time, step, and
    file_version or scalars {tag: value}."""
    data = Path(path).read_bytes()
    out, i = [], 0
    while i < len(data):
        n_b = data[i:i + 8]
        (n,) = struct.unpack("<Q", n_b)
        if struct.unpack("<I", data[i + 8:i + 12])[0] != masked_crc(n_b):
            raise ValueError(f"{path}: bad length CRC at byte {i}")
        rec = data[i + 12:i + 12 + n]
        if struct.unpack("<I", data[i + 12 + n:i + 16 + n])[0] != masked_crc(rec):
            raise ValueError(f"{path}: bad data CRC at byte {i}")
        i += 16 + n
        ev: dict = {"scalars": {}}
        for f, _, v in _fields(rec):
            if f == 1:
                ev["wall_time"] = struct.unpack("<d", v)[0]
            elif f == 2:
                ev["step"] = v - (1 << 64) if v >= 1 << 63 else v
            elif f == 3:
                ev["file_version"] = v.decode()
            elif f == 5:
                for sf, _, sv in _fields(v):
                    if sf != 1:
                        continue
                    tag, val = None, None
                    for vf, _, vv in _fields(sv):
                        if vf == 1:
                            tag = vv.decode()
                        elif vf == 2:
                            val = struct.unpack("<f", vv)[0]
                    ev["scalars"][tag] = val
        out.append(ev)
    return out
