"""Writing every byte: ``os.write`` and ``os.pwrite`` may write fewer bytes than asked.

A write that meets a full file system (a ``/dev/shm`` stage that another process filled, a
tmpfs at its size limit) returns a short count first and raises ``ENOSPC`` only on the next
try. A caller that ignores the count leaves a gap, and a gap at the end of a file that is then
cut or extended to its size reads back as zeros: bytes that were hashed on their way out but
never reached the file. These loop until all of ``data`` is written, or raise.
"""

from __future__ import annotations

import errno
import os

Bytes = bytes | bytearray | memoryview


def write_all(fd: int, data: Bytes) -> None:
    """Write all of ``data`` at ``fd``'s position (``OSError`` when the file takes no more)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, "the file system took no more bytes")
        view = view[n:]


def pwrite_all(fd: int, data: Bytes, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd`` (``OSError`` when the file takes no more)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, "the file system took no more bytes")
        view, offset = view[n:], offset + n
