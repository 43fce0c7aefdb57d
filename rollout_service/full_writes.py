"""Writing every byte: ``os.write`` and ``os.pwrite`` may write fewer bytes than asked.

A write that meets a full file system (a ``/dev/shm`` stage that another process filled, a
tmpfs at its size limit) returns a short count first and raises ``ENOSPC`` only on the next
try. A caller that ignores the count leaves a gap, and a gap at the end of a file that is then
cut or extended to its size reads back as zeros: bytes that were hashed on their way out but
never reached the file. These loop until all of ``data`` is written, or raise.

They also count what they write (:func:`bytes_written`): a sign of progress for whoever waits on
a write running elsewhere (the trainer waiting for its background sync).
"""

from __future__ import annotations

import errno
import os
import threading

Bytes = bytes | bytearray | memoryview

_written = 0
_written_lock = threading.Lock()


def bytes_written() -> int:
    """Bytes :func:`write_all` and :func:`pwrite_all` have written in this process so far, on any
    thread: a count that stops moving while a write is blocked in the storage."""
    return _written


def _count(n: int) -> None:
    global _written
    with _written_lock:
        _written += n


def write_all(fd: int, data: Bytes) -> None:
    """Write all of ``data`` at ``fd``'s position (``OSError`` when the file takes no more)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, "the file system took no more bytes")
        _count(n)
        view = view[n:]


def pwrite_all(fd: int, data: Bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd`` (``OSError`` when the file takes no more)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, "the file system took no more bytes")
        _count(n)
        view, offset = view[n:], offset + n
