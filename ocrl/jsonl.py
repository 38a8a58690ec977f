"""One JSONL file on disk, appended a whole row or nothing: the durability under the run
directory (records.py), which decides what the files are and which rows matter.

An append is written whole or cut back to where it started, so a reader sees all of a batch of
rows or none; a file found ending mid-row when opened (a crash while writing) is cut back to its
last whole row, so the next row never lands on a torn line; a failing write (a full disk, a
quota, an I/O error) raises `DiskFull` with nothing of the rows kept. A rewrite swaps the new
file in whole. Files are created mode 0600: they hold people's conversations. Knows bytes, rows
and fsync, never what a row means.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import msgspec

log = logging.getLogger("ocrl.records")

_encoder = msgspec.json.Encoder()


class DiskFull(OSError):
    """A record could not be written (no space, quota, I/O error); nothing of it was kept."""


def _write(fd: int, data: bytes) -> int:
    """One write(2); the seam the disk-full tests replace with short writes and ENOSPC."""
    from ocrl.faults import disk_full

    if disk_full():
        if len(data) > 1:  # a real full disk often takes part of a write first
            return os.write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return os.write(fd, data)


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines() if path.exists() else []


def decoded(path: Path, decoder: msgspec.json.Decoder):
    """The rows of a JSONL file, a torn line (the process died writing it) left out."""
    for line in lines(path):
        try:
            yield decoder.decode(line)
        except msgspec.DecodeError:
            log.warning("skipping a torn line in %s (the process died while writing it)", path.name)


def has_room(directory: Path, headroom: int) -> bool:
    """Whether `headroom` bytes can be written (and fsynced) in `directory` now."""
    probe = directory / ".space-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            written, block = 0, b"\0" * 65536
            while written < headroom:
                written += _write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError:
        return False
    return True


class Appender:
    """An open JSONL file taking whole rows at its end (fsynced each time when `durable`)."""

    def __init__(self, path: Path, durable: bool = False):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        self.path = path
        self.durable = durable
        self._cut_torn_tail()

    def _cut_torn_tail(self) -> None:
        """A file that does not end with a newline was cut off mid-row (a crash while writing):
        drop that partial row, or the next append would be glued onto it and lost."""
        size = os.fstat(self.fd).st_size
        if size == 0 or os.pread(self.fd, 1, size - 1) == b"\n":
            return
        keep = size
        while keep > 0:
            start = max(0, keep - 65536)
            chunk = os.pread(self.fd, keep - start, start)
            at = chunk.rfind(b"\n")
            if at >= 0:
                keep = start + at + 1
                break
            keep = start
        log.warning("%s ended in a torn row (%d bytes): cut back to the last whole row", self.path.name, size - keep)
        os.ftruncate(self.fd, keep)
        os.fsync(self.fd)

    def write(self, obj) -> None:
        self.write_many([obj])

    def write_many(self, objs) -> None:
        """Appends the rows whole (one fsync when durable), or raises `DiskFull` having cut the
        file back to where it was: a reader sees all of them or none."""
        data = b"".join(_encoder.encode(obj) + b"\n" for obj in objs)
        if not data:
            return
        start = os.fstat(self.fd).st_size
        try:
            written = 0
            while written < len(data):  # write(2) may take fewer bytes than offered (a full disk does)
                written += _write(self.fd, data[written:])
            if self.durable:
                os.fsync(self.fd)
        except OSError as e:
            try:
                os.ftruncate(self.fd, start)
            except OSError:
                log.exception("could not cut %s back after a failed write", self.path.name)
            raise DiskFull(e.errno, f"cannot write {self.path.name}: {e.strerror or e}") from None

    def rewritten(self, change) -> Appender:
        """The file with every row passed through `change`, swapped in whole (a crash leaves the
        old or the new file, never a mix); this appender is closed and a fresh one on the new
        file returned. Raises OSError (the old file untouched) when it cannot be written."""
        staging = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                for line in lines(self.path):
                    try:
                        line = _encoder.encode(change(msgspec.json.decode(line)))
                    except (msgspec.DecodeError, AttributeError, TypeError):
                        pass  # a row this does not understand stays as it was
                    out.write(line + b"\n")
                out.flush()
                os.fsync(out.fileno())
            os.replace(staging, self.path)
        except OSError:
            staging.unlink(missing_ok=True)
            raise
        self.close()
        return Appender(self.path, durable=self.durable)

    def close(self) -> None:
        os.close(self.fd)
