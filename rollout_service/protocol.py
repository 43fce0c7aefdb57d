"""The replica protocol, defined once: what a sidecar reports and how versions name steps.

A sidecar reports the same :class:`ReplicaReport` in two places: ``GET /status`` and
``GET /wait`` (with more fields beside it) and ``<root>/acks/<replica>.json`` (exactly it;
:func:`list_acks` and :func:`read_acks` read them, a bounded number of entries).
The trainer parses both with :meth:`ReplicaReport.from_dict`, which accepts only values of
the right types (ack files live in the untrusted root). SGLang labels loaded weights with a
weight version string; :func:`version_for_step` and :func:`step_for_version` are the only
conversions between the two. :func:`atomic_replace` is the project's one way of replacing
a small file atomically (write a hidden temporary file, fsync, rename).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import stat
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .checkpoint_format import ACKS_DIR, MAX_STEP, TEMP_PREFIX, CheckpointError
from .full_writes import write_all
from .number_text import step_from_text
from .shown_values import shown, shown_text
from .untrusted_files import read_small

log = logging.getLogger(__name__)

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
MAX_ACK_BYTES = 64 << 10
MAX_ACK_ENTRIES = 10_000
"""``<root>/acks`` is listed at most this far per read: it holds one file per replica (and a few
temporary ones), so a folder flooded with stray files costs a bounded read and a warning, not a hang."""
REPLICA_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}"
"""A replica id (matched whole): it names the replica's ack file, ``acks/<id>.json``."""
ACK_FILE_RE = re.compile(rf"{REPLICA_ID_PATTERN}\.json", re.ASCII)
"""An ack file's name (matched whole): a replica id as the sidecar accepts one, then ``.json``."""
ACK_INTERVAL_S = 5.0
"""How often a sidecar rewrites its ack file (its heartbeat), by default."""
MIN_HEARTBEAT_MAX_AGE_S = 3 * ACK_INTERVAL_S
"""The least age after which a reader may count an ack's heartbeat as dead: three missed writes
(a shorter one takes a live replica, between two writes, for a dead one)."""
MAX_REPORTED_REJECTIONS = 100
"""Entries of a report's ``rejected`` (and of its ``last_error``) a reader keeps."""
MAX_CLOCK_SKEW_S = 300.0
"""How far in the future an ack's heartbeat may lie (the sidecar's clock ahead of the reader's);
further, the ack is a stray or forged file and counts as dead, or it would count as live forever."""


def version_for_step(step: int) -> str:
    """The weight version SGLang is given for checkpoint step ``step`` (what completions carry)."""
    return str(step)


def step_for_version(version: Any) -> int | None:
    """The step a weight version names, or None (SGLang's start-up ``"default"``, junk, ...)."""
    if isinstance(version, bool):
        return None
    if isinstance(version, int):
        return version if 0 <= version <= MAX_STEP else None
    return step_from_text(version)


def adapter_name_for(step: int, run_id: str | None) -> str:
    """The name a sidecar loads step ``step``'s LoRA adapter under, and the trainer's requests
    give as ``lora_path``: fresh per version (SGLang keys its prefix cache by adapter name)."""
    return f"v{step:08d}" + (f"-{run_id}" if run_id else "")


def step_for_adapter_name(name: Any) -> int | None:
    """The step an adapter name from :func:`adapter_name_for` names, or None."""
    if (
        not isinstance(name, str)
        or len(name) < 9
        or name[0] != "v"
        or step_from_text(name[1:9]) is None
        or (len(name) > 9 and name[9] != "-")
    ):
        return None
    return int(name[1:9])


@dataclass
class ReplicaReport:
    """One replica's state as the trainer needs it (the ack file, and part of ``/status``)."""

    replica_id: str
    loaded_step: int | None = None
    weight_version: str | None = None
    run_id: str | None = None
    """The run whose checkpoint SGLang serves (the manifest's ``run_id``)."""
    fingerprint: str | None = None
    loaded_current: bool = True
    """False once the served checkpoint is no longer the one published under its name."""
    loading_step: int | None = None
    ready: bool = False
    sglang_healthy: bool = False
    sglang_url: str | None = None
    last_error: dict[str, Any] | None = None
    rejected: dict[str, str] = field(default_factory=dict)
    fatal: dict[str, Any] | None = None
    """Set when the replica cannot load any checkpoint until it is fixed (its ``reason`` and
    ``message``): the trainer stops waiting for it."""
    heartbeat: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, *, replica_id: str = "") -> ReplicaReport:
        """Parse a report; fields of the wrong type read as absent (never raises on bad input)."""
        if not isinstance(data, dict):
            return cls(replica_id=replica_id)

        def typed(key: str, kinds: tuple[type, ...], default: Any = None) -> Any:
            value = data.get(key, default)
            if isinstance(value, bool) and bool not in kinds:
                return default
            return value if isinstance(value, kinds) else default

        rejected = typed("rejected", (dict,), {})
        error = typed("last_error", (dict,))
        return cls(
            replica_id=typed("replica_id", (str,), replica_id) or replica_id,
            loaded_step=_step(data.get("loaded_step")),
            weight_version=typed("weight_version", (str,)),
            run_id=typed("run_id", (str,), typed("loaded_run_id", (str,))),
            fingerprint=typed("fingerprint", (str,), typed("loaded_fingerprint", (str,))),
            loaded_current=typed("loaded_current", (bool,), True),
            loading_step=_step(data.get("loading_step")),
            ready=typed("ready", (bool,), False),
            sglang_healthy=typed("sglang_healthy", (bool,), False),
            sglang_url=typed("sglang_url", (str,)),
            last_error=error,
            rejected={
                shown_text(k, 40): shown_text(v, 300) for k, v in list(rejected.items())[:MAX_REPORTED_REJECTIONS]
            }
            if isinstance(rejected, dict)
            else {},
            fatal=typed("fatal", (dict,)),
            heartbeat=_seconds(data.get("heartbeat")),
        )


def _step(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_STEP else None


def _seconds(value: Any) -> float | None:
    """``value`` as a finite float (a time in seconds), or None (not a number, NaN, Inf, too large)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        seconds = float(value)
    except OverflowError:  # an integer of hundreds of digits
        return None
    return seconds if math.isfinite(seconds) else None


def _describe(value: Any) -> str:
    """A short description of an untrusted JSON value, for a message."""
    if value is None:
        return "missing"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"an integer of {value.bit_length()} bits"
    return f"{type(value).__name__} {shown_text(value, 40)!r}"


def heartbeat_problem(value: Any, *, now: float, max_age_s: float | None = None) -> str | None:
    """Why an ack whose ``heartbeat`` is ``value`` does not show a live replica; None when it does.

    A heartbeat must be a finite time (seconds since the epoch), at most :data:`MAX_CLOCK_SKEW_S`
    ahead of ``now``, and, with ``max_age_s``, at most that old. Never raises (acks are untrusted).
    """
    seconds = _seconds(value)
    if seconds is None:
        return f"heartbeat is {_describe(value)}, not a finite time in seconds"
    age = now - seconds
    if age < -MAX_CLOCK_SKEW_S:
        return (
            f"heartbeat {-age:.0f} s in the future (more than the {MAX_CLOCK_SKEW_S:g} s of clock skew"
            " allowed: a stray file, or a clock to fix)"
        )
    if max_age_s is not None and age > max_age_s:
        return f"last heartbeat {age:.0f} s ago by this host's clock"
    return None


class HeartbeatClock:
    """A reader's memory of each replica's heartbeat, timed on the reader's own monotonic clock.

    :func:`heartbeat_problem` compares the replica's wall clock with the reader's: a replica whose
    host clock runs behind by more than ``max_age_s`` looks dead however often it writes. A
    heartbeat this reader saw move on between two of its reads at most ``max_age_s`` apart shows
    a live replica for ``max_age_s`` after that read, whatever the two clocks say, as long as it is
    no more than :data:`MAX_CLOCK_SKEW_S` older than ``max_age_s`` allows (the same allowance a
    heartbeat in the future gets). Until it was seen to move (the first read), the age decides.
    Safe to use from several threads.
    """

    def __init__(self, monotonic: Any = time.monotonic) -> None:
        self._monotonic = monotonic
        self._seen: dict[str, tuple[float, float, float | None]] = {}
        """replica -> (its heartbeat, the monotonic time of this reader's last read of it, the
        monotonic time of the read that last saw it move on, or None)."""
        self._lock = threading.Lock()

    def problem(self, name: str, value: Any, *, now: float, max_age_s: float) -> str | None:
        """:func:`heartbeat_problem` of ``value``, except that a heartbeat seen to move on within
        ``max_age_s`` is not too old (see the class). Never raises (acks are untrusted)."""
        seconds = _seconds(value)
        why = heartbeat_problem(value, now=now, max_age_s=max_age_s)
        if seconds is None:
            with self._lock:
                self._seen.pop(name, None)
            return why
        mono = self._monotonic()
        with self._lock:
            previous = self._seen.get(name)
            moved_at = None
            if previous is not None:
                last, read_at, moved_before = previous
                if seconds > last and mono - read_at <= max_age_s:  # written since a recent read
                    moved_at = mono
                elif seconds == last:
                    moved_at = moved_before
            self._seen[name] = (seconds, mono, moved_at)
        if why is None or seconds > now:  # fresh, or in the future (that allowance is the function's)
            return why
        if moved_at is not None and mono - moved_at <= max_age_s and now - seconds <= max_age_s + MAX_CLOCK_SKEW_S:
            return None  # it moves: the replica's clock is behind this host's
        return why

    def keep_only(self, names: Any) -> None:
        """Forget the replicas not among ``names`` (their ack files are gone)."""
        keep = set(names)
        with self._lock:
            for name in [n for n in self._seen if n not in keep]:
                del self._seen[name]


_TEMP_SUFFIX_HEX = 8
"""Random hex digits that end an :func:`atomic_replace` temporary file's name."""


def is_owned_temp(name: str, owner: str) -> bool:
    """Whether ``name`` is a temporary file :func:`atomic_replace` made for ``owner``, and no one
    else's (``.tmp-a-1234abcd`` is replica ``a``'s; ``.tmp-a-b-1234abcd`` is replica ``a-b``'s)."""
    prefix = f"{TEMP_PREFIX}{owner}-"
    rest = name[len(prefix) :]
    return name.startswith(prefix) and len(rest) == _TEMP_SUFFIX_HEX and all(c in "0123456789abcdef" for c in rest)


def atomic_replace(dir_fd: int, name: str, data: bytes, *, owner: str = "") -> None:
    """Replace file ``name`` in the directory open as ``dir_fd`` with ``data``, atomically.

    The bytes go to a hidden ``.tmp-<owner>-*`` file (created with ``O_EXCL | O_NOFOLLOW``),
    are fsynced, and the temporary file is renamed over ``name``; a crash leaves either the
    old file or the new one, plus at most the temporary file.
    """
    tmp = f"{TEMP_PREFIX}{owner + '-' if owner else ''}{uuid.uuid4().hex[:_TEMP_SUFFIX_HEX]}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | _NOFOLLOW, 0o644, dir_fd=dir_fd)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


ACK_EXPIRY_S = 24 * 3600.0
"""An ack whose heartbeat is older than this is a replica gone for good (Kubernetes names each
replica after its pod, so every pod ever started leaves a file): :func:`remove_expired_acks`
removes it, so that ``acks`` does not grow past :data:`MAX_ACK_ENTRIES`, where it is no longer
read whole and retention stops."""


def remove_expired_acks(root: Path, acks: dict[str, dict[str, Any]], *, now: float) -> list[str]:
    """Remove the ack files among ``acks`` (a :func:`list_acks` result) whose heartbeat is older
    than :data:`ACK_EXPIRY_S`; return the replica ids removed. Each file is read again just
    before it goes (a replica back meanwhile keeps its ack), and removed through the folder's
    descriptor (a folder swapped for a link is not followed). Failures are logged, never raised."""
    expired = [
        name
        for name, ack in acks.items()
        if (seconds := _seconds(ack.get("heartbeat"))) is not None and now - seconds > ACK_EXPIRY_S
    ]
    if not expired:
        return []
    directory = Path(root) / ACKS_DIR
    removed: list[str] = []
    try:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | _NOFOLLOW)
    except OSError as exc:
        log.warning("could not open %s to remove the acks of replicas gone for a day: %s", directory, exc)
        return []
    try:
        for name in expired:
            try:
                again = _read_ack(directory, f"{name}.json")
            except _AckUnreadable:
                continue
            seconds = None if again is None else _seconds(again.get("heartbeat"))
            if seconds is None or now - seconds <= ACK_EXPIRY_S:
                continue
            try:
                os.unlink(f"{name}.json", dir_fd=dir_fd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("could not remove %s, the ack of a replica gone for a day: %s", directory / name, exc)
                continue
            removed.append(name)
    finally:
        os.close(dir_fd)
    return removed


class AcksCutShort(RuntimeError):
    """``<root>/acks`` was not read to its end (see :func:`list_acks`): an ack may have been
    missed, so what the replicas hold is not known whole. Raised for callers that must not act on
    part of it (retention: a step a missed replica serves would be deleted)."""


def read_acks(root: Path, *, max_age_s: float | None = None, whole: bool = False) -> dict[str, dict[str, Any]]:
    """Ack payloads by replica id; with ``max_age_s``, only replicas whose heartbeat is that fresh.

    Reads as :func:`list_acks` does (bounded; files that are not small regular JSON objects are
    skipped, the root is untrusted), and with ``max_age_s`` also skips acks whose heartbeat
    :func:`heartbeat_problem` refuses. A listing cut short is logged as a warning, or with
    ``whole`` raises :class:`AcksCutShort` saying why.
    """
    listing = list_acks(root)
    if listing.cut_short is not None:
        if whole:
            raise AcksCutShort(listing.cut_short)
        log.warning("%s", listing.cut_short)
    if max_age_s is None:
        return listing.acks
    return fresh_acks(listing.acks, now=time.time(), max_age_s=max_age_s)


def read_ack(root: Path, replica_id: str) -> dict[str, Any] | None:
    """One replica's ack payload, read as :func:`list_acks` reads each (bounded, no link
    followed), or None when there is none or it cannot be read: a restarted sidecar reads its
    own, for what it last said it served."""
    directory = Path(root) / ACKS_DIR
    try:
        if not stat.S_ISDIR(os.lstat(directory).st_mode):
            return None
        return _read_ack(directory, f"{replica_id}.json")
    except (OSError, _AckUnreadable):
        return None


def fresh_acks(acks: dict[str, dict[str, Any]], *, now: float, max_age_s: float) -> dict[str, dict[str, Any]]:
    """The acks of live replicas: those whose heartbeat :func:`heartbeat_problem` accepts."""
    return {
        name: ack
        for name, ack in acks.items()
        if heartbeat_problem(ack.get("heartbeat"), now=now, max_age_s=max_age_s) is None
    }


@dataclass
class AckListing:
    """What one read of ``<root>/acks`` found (see :func:`list_acks`)."""

    acks: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Payloads by replica id, whatever their heartbeat."""
    cut_short: str | None = None
    """Why the folder was not read to its end, and what to do; None when it was."""


def list_acks(root: Path, *, deadline: float | None = None) -> AckListing:
    """Every readable ack file under ``<root>/acks``, read with bounds (the root is untrusted).

    Only names matching :data:`ACK_FILE_RE` are opened (through :func:`read_small`), so temporary
    and other stray files cost one directory entry each. At most :data:`MAX_ACK_ENTRIES` entries
    are listed, and none once ``deadline`` (a ``time.monotonic()`` value) has passed; either way
    :attr:`AckListing.cut_short` says so. An ack among stray files is thus found whenever the
    folder holds at most :data:`MAX_ACK_ENTRIES` entries and there is time to read them; past
    that, entries come in the file system's order and an ack may be missed. An ack file the
    storage fails to open or read (``EIO``, ``ESTALE`` while a sidecar replaces it over NFS, no
    permission) may be a live replica's: it also makes ``cut_short`` say so (the rest are read).
    A file that is read but is not an ack (not a small regular JSON object) is skipped. A missing
    folder, or one that is not a directory (a symlink), holds no acks.
    """
    directory = Path(root) / ACKS_DIR
    listing = AckListing()
    unread: list[str] = []
    try:
        if not stat.S_ISDIR(os.lstat(directory).st_mode):
            return listing
        with os.scandir(directory) as entries:
            for count, entry in enumerate(entries):
                listing.cut_short = _ack_listing_stop(directory, count, deadline)
                if listing.cut_short is not None:
                    break
                if ACK_FILE_RE.fullmatch(entry.name):
                    try:
                        ack = _read_ack(directory, entry.name)
                    except _AckUnreadable as exc:
                        unread.append(f"{entry.name} ({exc})")
                        continue
                    if ack is not None:
                        listing.acks[entry.name[: -len(".json")]] = ack
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as exc:
        listing.cut_short = f"{directory} could not be listed ({exc}): check the checkpoint root's file system"
    if listing.cut_short is None and unread:
        listing.cut_short = (
            f"{len(unread)} ack file(s) in {directory} could not be read: {'; '.join(unread[:3])}. An ack there may"
            " be a live replica's: check the storage, or fix the file (its permissions) or remove it if no sidecar"
            " writes it"
        )
    return listing


def _ack_listing_stop(directory: Path, count: int, deadline: float | None) -> str | None:
    """Why :func:`list_acks` stops before entry number ``count`` (from 0) of ``directory``; None: read on."""
    if count >= MAX_ACK_ENTRIES:
        return (
            f"{directory} holds more than {MAX_ACK_ENTRIES} entries, past which it is not read (acks listed after"
            f" them are missed): it should hold one <replica-id>.json per sidecar; remove the other files from it"
        )
    if deadline is not None and time.monotonic() >= deadline:
        return (
            f"reading {directory} ran out of time after {count} entries: a slow file system, or stray files"
            f" there (it should hold one <replica-id>.json per sidecar; remove the other files from it)"
        )
    return None


class _AckUnreadable(Exception):
    """An ack file the storage failed to open or read: what it says is not known."""


def _read_ack(directory: Path, name: str) -> dict[str, Any] | None:
    """The fields a reader uses of the JSON object in ack file ``name`` (:func:`_ack_fields`), or
    None when it is not a small regular JSON object file (or is gone). Raises
    :class:`_AckUnreadable` when the storage failed to open or read it."""
    try:
        data = json.loads(read_small(directory, directory / name, where=name, max_bytes=MAX_ACK_BYTES))
    except CheckpointError as exc:
        if exc.reason == "unreadable":
            raise _AckUnreadable(str(exc)) from None
        return None
    except OSError as exc:
        raise _AckUnreadable(str(exc)) from None
    except (ValueError, RecursionError):
        return None
    return _ack_fields(data) if isinstance(data, dict) else None


_ACK_FIELDS = frozenset(f.name for f in fields(ReplicaReport)) | {"loaded_run_id", "loaded_fingerprint"}
MAX_ACK_TEXT = 1024
"""Characters kept of a string in an ack (a replica writes ids, versions and short messages)."""


def _ack_fields(data: dict[str, Any]) -> dict[str, Any]:
    """What a reader keeps of an ack file's object: the fields a :class:`ReplicaReport` has, each a
    number, ``None``, a string (cut to :data:`MAX_ACK_TEXT`) or, one level down (``last_error``,
    ``rejected``), an object of at most :data:`MAX_REPORTED_REJECTIONS` such values. So a read of
    10,000 forged acks holds kilobytes each, not the megabytes 64 KiB of ``{}`` parse to, and
    nothing is nested deep enough to fail when quoted (``RecursionError``)."""

    def flat(value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float)):
            return value
        if isinstance(value, str):
            return value[:MAX_ACK_TEXT]
        return shown(value)  # a container: described, not kept

    kept: dict[str, Any] = {}
    for key in _ACK_FIELDS & data.keys():
        value = data[key]
        if isinstance(value, dict):
            kept[key] = {k[:MAX_ACK_TEXT]: flat(v) for k, v in list(value.items())[:MAX_REPORTED_REJECTIONS]}
        else:
            kept[key] = flat(value)
    return kept
