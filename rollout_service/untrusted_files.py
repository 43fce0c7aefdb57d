"""Opening files found under the checkpoint root, which anyone with write access can craft.

Everything a reader takes from the root goes through :func:`open_regular`: the path must
resolve inside the root, the open never blocks (``O_NONBLOCK``: a FIFO or a device named
like a checkpoint file is refused after ``fstat`` instead of hanging the reader), the file
must be a regular file, and its size must be under a cap. :func:`read_small` reads such a
file whole (manifests, indexes, configs) with a byte cap, so ``manifest.json -> /dev/zero``
or a 10 GB "manifest" cannot exhaust memory. :class:`Deadline` bounds a whole validation.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .checkpoint_format import CheckpointError
from .checkpoint_paths import path_within, resolve_inside
from .digest import format_digest, new_hasher
from .full_writes import write_all

MAX_SMALL_FILE_BYTES = 16 << 20
"""Cap on manifest.json, the shard index and config.json (real ones are kilobytes)."""


DEFAULT_TIMEOUT_FLAG = "the sidecar's --validate-timeout (validate's --timeout)"


class Deadline:
    """A wall-clock budget; :meth:`check` raises ``CheckpointError('validation_timeout')``."""

    def __init__(self, seconds: float | None, what: str = "validation", flag: str = DEFAULT_TIMEOUT_FLAG):
        self.seconds = seconds
        self.what = what
        self.flag = flag
        """The setting that gives this budget, named in the error."""
        self.started = time.monotonic()
        self._end = None if seconds is None else self.started + seconds

    def check(self, where: str = "") -> None:
        if self._end is not None and time.monotonic() > self._end:
            raise CheckpointError(
                "validation_timeout",
                f"{self.what} took longer than {self.seconds:g} s{f' ({where})' if where else ''};"
                f" the storage is too slow or the checkpoint too large: raise {self.flag}",
            )


NO_DEADLINE = Deadline(None)


@contextlib.contextmanager
def open_regular(
    root: Path, path: Path, *, where: str, max_bytes: int | None = None
) -> Iterator[tuple[int, os.stat_result]]:
    """Yield ``(fd, fstat)`` of ``path``: inside ``root``, a regular file, at most ``max_bytes``.

    Raises ``CheckpointError`` with ``path_escape``, ``missing_file``, ``not_a_regular_file``,
    ``too_large`` or ``unreadable``. The descriptor is closed on exit. The resolved path is
    opened one component at a time from the root, none followed if it is a link
    (:func:`_open_beneath`): a folder swapped for a link out of the root between the check and the
    open is refused without a look where it points (a hung mount there would block the open for
    good), and where the file opened lies is checked again on its descriptor.
    """
    real = resolve_inside(root, path)
    top = os.path.realpath(root)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = _open_beneath(top, real, flags, where)
    except FileNotFoundError:
        raise CheckpointError("missing_file", f"{where} does not exist") from None
    except OSError as exc:
        try:  # a socket (ENXIO) or a link (ELOOP) cannot be opened: name what it is
            mode = os.lstat(real).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise CheckpointError(
                "not_a_regular_file",
                f"{where} is not a regular file ({_kind(mode)}); checkpoints hold only regular files:"
                " remove it and republish",
            ) from None
        raise unreadable(exc, f"{where} cannot be opened: {exc.strerror}") from None
    try:
        _check_opened_inside(fd, top, where)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(
                "not_a_regular_file",
                f"{where} is not a regular file ({_kind(st.st_mode)}); checkpoints hold only"
                " regular files: remove it and republish",
            )
        if max_bytes is not None and st.st_size > max_bytes:
            raise CheckpointError("too_large", f"{where} has {st.st_size} bytes, more than the {max_bytes} allowed")
        os.set_blocking(fd, True)
        yield fd, st
    finally:
        os.close(fd)


@contextlib.contextmanager
def any_failure_is_the_steps(name: str, what: str = "checkpoint") -> Iterator[None]:
    """Whatever breaks while reading untrusted step ``name`` is that step's fault: a
    ``CheckpointError`` passes, anything else becomes one (``unreadable``), so callers have
    one error to handle and a reason to report."""
    try:
        yield
    except CheckpointError:
        raise
    except MemoryError:
        raise CheckpointError(
            "unreadable", f"{name}: out of memory while reading it; the {what} is not what its manifest describes"
        ) from None
    except OSError as exc:
        raise unreadable(exc, f"{name} cannot be read: {type(exc).__name__}: {str(exc)[:200]}") from None
    except Exception as exc:
        raise CheckpointError("unreadable", f"{name} cannot be read: {type(exc).__name__}: {str(exc)[:200]}") from None


STORAGE_ERRNOS = frozenset(
    {
        errno.EIO,
        errno.ESTALE,
        errno.ETIMEDOUT,
        errno.ENOTCONN,
        errno.ECONNRESET,
        errno.EHOSTDOWN,
        errno.EREMOTEIO,
        errno.EAGAIN,
        errno.EMFILE,
        errno.ENFILE,
        errno.ENOMEM,
    }
)
"""Errors a read or an open gets from the storage or this process, not from what the file is:
a step that meets one is validated again before it is rejected (see :class:`UnreadableFile`)."""


def unreadable(exc: OSError, message: str) -> CheckpointError:
    """``CheckpointError('unreadable')`` saying ``message``; an :class:`UnreadableFile` (also an
    ``OSError``) when ``exc`` is the storage's failure (:data:`STORAGE_ERRNOS`), not the file's."""
    if exc.errno in STORAGE_ERRNOS:
        return UnreadableFile(exc.errno, message)
    return CheckpointError("unreadable", message)


class UnreadableFile(CheckpointError, OSError):
    """``CheckpointError('unreadable')`` for a file whose read failed in the storage once it was
    open (``EIO``, ``ESTALE``), naming the file. It is also the ``OSError`` the read raised (the
    same ``errno``, no file name), so that code that tells the storage's faults apart by
    ``OSError`` still does: the sidecar's stage counts a copy's manifest that its own failing disk
    cannot read as its fault (tried again), not the step's."""

    def __init__(self, code: int | None, message: str):
        CheckpointError.__init__(self, "unreadable", message)
        self.errno, self.strerror = code, message

    def __str__(self) -> str:
        return str(self.args[0])


def read_small(root: Path, path: Path, *, where: str, max_bytes: int = MAX_SMALL_FILE_BYTES) -> bytes:
    """The bytes of a small regular file under ``root``, never more than ``max_bytes``.

    Raises ``CheckpointError``: as :func:`open_regular` does, ``too_large``, and for a read the
    storage fails (an I/O error, a stale NFS handle) :class:`UnreadableFile` naming the file."""
    try:
        with open_regular(root, path, where=where, max_bytes=max_bytes) as (fd, _):
            chunks = []
            total = 0
            while True:
                chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
                if total > max_bytes:  # the file grew after fstat
                    raise CheckpointError("too_large", f"{where} holds more than {max_bytes} bytes")
    except CheckpointError:
        raise
    except OSError as exc:  # read, fstat or close: the storage's error, on this file
        raise UnreadableFile(
            exc.errno, f"{where} cannot be read: {exc.strerror or exc} (the storage failed while reading it)"
        ) from exc
    return b"".join(chunks)


_COPY_CHUNK = 16 << 20


def copy_verified(root: Path, src: Path, dst: Path, *, where: str, size: int, digest: str, deadline: Deadline) -> None:
    """Copy ``src`` (untrusted, under ``root``) to ``dst``, checking its size and digest as it streams.

    ``dst`` is a new file, or an old one that is written over and cut to ``size`` (the stage's
    spare: no fresh pages to fill). A file that changes while it is read raises
    ``truncated``/``size_mismatch``/``digest_mismatch``: nothing written is trusted until
    this returns.
    """
    hasher = new_hasher()
    copied = 0
    buf = bytearray(_COPY_CHUNK)
    view = memoryview(buf)
    with open_regular(root, src, where=where) as (fd, _), _open_for_overwrite(dst) as out:
        while copied <= size:
            deadline.check(where)
            n = os.readv(fd, [view])
            if not n:
                break
            if copied + n > size:
                copied += n
                break
            hasher.update(view[:n])
            write_all(out.fileno(), view[:n])  # every byte, or an error: a gap would read as zeros
            copied += n
        if copied == size:
            out.truncate(size)  # an old file written over: cut what was longer
    _check_read(where, copied, size, hasher, digest)


def _check_read(where: str, copied: int, size: int, hasher: Any, digest: str) -> None:
    if copied != size:
        raise CheckpointError(
            "size_mismatch" if copied > size else "truncated",
            f"{where} changed while it was being read: {'more' if copied > size else 'fewer'}"
            f" bytes than the manifest's {size}; the writer modified a published file",
        )
    found = format_digest(hasher)
    if found != digest:
        raise CheckpointError(
            "digest_mismatch",
            f"{where} has digest {found}, the manifest says {digest}: the file's bytes changed after publishing",
        )


class VerifiedRead:
    """An untrusted file under ``root`` read into memory front to back as its bytes are needed.

    :attr:`data` is a ``size``-byte view; :meth:`upto` makes its first ``n`` bytes valid
    (reading on, hashing as it goes), so a caller can use the front of a file while the rest
    is still on the wire (a delta file over a network file system). Nothing read is trusted
    until :meth:`finish` read the rest and checked the size and digest: a file that changes
    while it is read raises ``truncated``/``size_mismatch``/``digest_mismatch``. Use it as a
    context manager (it holds the file open).
    """

    def __init__(self, root: Path, src: Path, *, where: str, size: int, digest: str, deadline: Deadline):
        self.where, self.size, self.digest, self.deadline = where, size, digest, deadline
        self._opened = open_regular(root, src, where=where)
        self._fd, st = self._opened.__enter__()
        try:
            if st.st_size != size:  # before a buffer is sized by a number from the manifest
                raise CheckpointError(
                    "size_mismatch" if st.st_size > size else "truncated",
                    f"{where} has {st.st_size} bytes on disk, the manifest says {size}",
                )
            self._buf = bytearray(size)
        except BaseException:
            self.close()
            raise
        self.data = memoryview(self._buf)
        self._hasher = new_hasher()
        self._got = 0

    def __enter__(self) -> VerifiedRead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the file (:attr:`data` stays readable)."""
        self._opened.__exit__(None, None, None)

    def upto(self, n: int) -> None:
        """Read until the first ``n`` bytes (at most :attr:`size`) are in :attr:`data`."""
        n = min(n, self.size)
        while self._got < n:
            self.deadline.check(self.where)
            k = os.readv(self._fd, [self.data[self._got : min(self._got + _COPY_CHUNK // 4, self.size)]])
            if not k:
                _check_read(self.where, self._got, self.size, self._hasher, self.digest)
            self._hasher.update(self.data[self._got : self._got + k])
            self._got += k

    def finish(self) -> None:
        """Read the rest; raise unless the file held exactly ``size`` bytes with ``digest``."""
        self.upto(self.size)
        extra = os.read(self._fd, 1)
        _check_read(self.where, self._got + len(extra), self.size, self._hasher, self.digest)


def _open_for_overwrite(path: Path) -> io.FileIO:
    """``path`` for writing from its start, created if missing, not truncated (see copy_verified)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    return io.FileIO(fd, "wb", closefd=True)


def _open_beneath(top: str, real: Path, flags: int, where: str) -> int:
    """Open ``real`` (a resolved path inside ``top``, the root's real folder) walking down from
    ``top``, each folder on the way opened with ``O_NOFOLLOW | O_DIRECTORY`` relative to the one before: a
    component that became a link (or anything but a folder) since ``real`` was resolved raises
    ``CheckpointError('path_escape')`` without being followed. (Linux's ``openat2`` with
    ``RESOLVE_BENEATH`` does this in one call; Python has no binding for it.)"""
    try:
        parts = Path(real).relative_to(top).parts
    except ValueError:
        raise _swapped(where) from None
    if not parts:
        return os.open(real, flags)
    folder_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    dir_fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            try:
                below = os.open(part, folder_flags, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _swapped(where) from None
                raise
            os.close(dir_fd)
            dir_fd = below
        return os.open(parts[-1], flags, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _swapped(where: str) -> CheckpointError:
    return CheckpointError(
        "path_escape",
        f"{where} was opened outside the checkpoint root (a folder on its path was replaced by a"
        " link while it was opened); only files inside the root are read",
    )


def _check_opened_inside(fd: int, top: str, where: str) -> None:
    """Where ``fd`` really is must lie inside ``top``, the root's real folder (Linux names it in
    ``/proc/self/fd``; elsewhere the check before the open stands alone)."""
    try:
        opened = os.readlink(fd_path(fd))
    except OSError:
        return
    if not path_within(opened, top):
        raise _swapped(where)


def fd_path(fd: int) -> str:
    """A path that opens exactly the inode behind ``fd`` (for libraries that take paths)."""
    return f"/proc/self/fd/{fd}"


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symlink"),
    ):
        if test(mode):
            return name
    return "not a plain file"
