"""Node-local staging: SGLang loads only bytes the sidecar copied and verified itself.

Validating files on shared storage and then letting SGLang open them leaves a window in
which a writer can change them (time of check to time of use). The sidecar therefore
copies each published checkpoint into a directory only it writes (``--stage-dir``:
``/dev/shm`` when it has room, else a local folder), checks every byte of the copy against
the manifest's digests as it copies, validates the copy (headers, reference, finiteness),
and hands SGLang the copy. A copy becomes visible under its final name only by an atomic
rename, so a sidecar killed mid-copy leaves a hidden ``.tmp-*`` folder that the next start
removes. The stage holds the served copy, at most one being prepared, and a spare (below).

The stage works in a folder of its own and touches only the names it makes
(:mod:`~rollout_service.sidecar.stage_folder`: its marker, its lock, reclaiming the ``/dev/shm``
stages of sidecars that are gone).

A ``delta`` step is rebuilt here (:meth:`Stage.build`): applied to the staged copy of its
base while SGLang keeps serving that copy, every tensor and file checked against the digests
of the full checkpoint it stands for, renamed into place only when complete. A sidecar that
has no copy of the base (a restart with an emptied stage, a late joiner) replays the chain
from its full step; a missing or corrupt link rejects the step with a reason. Staged copies
are named ``step-XXXXXXXX-<fingerprint>`` after the *published* manifest they stand for, and a
step staged before (SGLang restarted and lost it) is loaded again from its staged copy once
every byte of it was checked against its digests, without reading shared storage.

Room: a full step or the next delta beside the served copy needs room for two copies of the
model. A replica more than one delta behind (or replaying a chain) holds, beside the served
copy, the last version it rebuilt and the next one (a delta is applied to the version before
it, which is dropped as soon as the next is complete): room for three copies. The whole chain's
room is checked before anything is written (``StageError`` saying how many copies it needs).

A copy that stops being served is kept as a hidden *spare* (one at most, and only while the
stage's file system would still have room for another copy): the next copy or rebuild writes
over its files instead of new ones. On tmpfs, filling fresh pages costs more than the copy
itself (1.6 GB/s against 5 GB/s for writing over existing ones, measured on the CPU test bed),
so this roughly halves what staging a version costs there. The spare is named ``.tmp-*``: a
restart removes it. Its bytes are never trusted: every byte written over them is checked
against the published digests like any other. They count as room for the next copy.

A stage the user did not choose (no ``--stage-dir``: ``/dev/shm`` picked at start-up, when the
model's size is not known yet) moves to the local-disk default at the first step that does not
fit there (:meth:`Stage._move`), instead of refusing every step for good. A stage given with
``--stage-dir`` stays where it was given: a step that does not fit is refused, saying so.

The stage also keeps ``reference.json``: the tensor names, shapes and dtypes of the model
SGLang serves, learnt at the first load, so a restarted sidecar checks against the same
reference.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TypeVar

from ..checkpoint_format import (
    MANIFEST_NAME,
    TEMP_PREFIX,
    CheckpointError,
    FileEntry,
    Manifest,
    parse_step_dir_name,
    step_dir_name,
)
from ..checkpoint_paths import is_inside
from ..checkpoint_reader import TensorSpecs, read_every_byte
from ..delta_apply import Chain, ChainLink, reconstruct, resolve_chain
from ..protocol import atomic_replace
from ..untrusted_files import Deadline, copy_verified, read_small
from .stage_folder import (
    COPY_NAME_RE,
    LOCK_NAME,
    MARKER_NAME,
    REFERENCE_NAME,
    SHM_DIR,
    SHM_STAGE_PREFIX,
    WORK_FOLDER_MODE,
    StageError,
    bytes_under,
    check_is_stage,
    check_owner,
    close_to_others,
    empty_stage,
    foreign_copy,
    is_default_shm_stage,
    is_work_name,
    mark_as_stage,
    open_own_file,
    reclaim_shm_leftovers,
    remove_entry,
    resolve_stage_path,
    reusable_file,
    seal_copy,
    shm_stages_held,
    take_lock,
)

__all__ = [
    "LOCK_NAME",
    "MARKER_NAME",
    "REFERENCE_NAME",
    "Stage",
    "StageError",
    "StagedBuild",
    "default_stage_dir",
    "disk_stage_dir",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

SPARE_PREFIX = f"{TEMP_PREFIX}spare-"
SPACE_MARGIN_BYTES = 64 << 20
WRITE_ONLY_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})
"""OSError numbers that only writing raises: in a build they can only come from the stage."""
PROBE_BYTES = 4096


@dataclass
class StagedBuild:
    """A verified full copy in the stage, and what making it took."""

    path: Path
    kind: str
    """The published step's kind: ``full`` (copied) or ``delta`` (rebuilt)."""
    bytes_read: int
    """Bytes read from shared storage."""
    apply_s: float
    chain_length: int
    """Deltas applied (more than one: a chain replayed from its full step or a staged copy)."""
    finite_checked: bool = False
    """Every tensor of the copy was checked for NaN/Inf on its way here (a rebuild onto a staged
    copy, checked when it was staged, with ``check_finite``); else the caller checks the copy."""


MAX_FINITE_MARKS = 16
"""Copies :meth:`Stage.mark_finite` remembers (a stage holds two or three at a time)."""
SHM_MIN_FREE_BYTES = 8 << 30
"""/dev/shm is chosen by default only when this much is free (a container's default /dev/shm
is 64 MiB; two copies of a 7B bf16 model need ~30 GB)."""


def default_stage_dir(replica_id: str, needed_bytes: int = SHM_MIN_FREE_BYTES // 2) -> Path:
    """``/dev/shm/rollout-stage-<replica>`` when /dev/shm has room for two copies of
    ``needed_bytes``, else ``$XDG_CACHE_HOME/rollout-service/stage/<replica>`` (``XDG_CACHE_HOME``
    defaults to ``~/.cache``)."""
    if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK):
        try:
            free = shutil.disk_usage(SHM_DIR).free
        except OSError:
            free = 0
        if free > 2 * needed_bytes + SPACE_MARGIN_BYTES:
            return SHM_DIR / f"{SHM_STAGE_PREFIX}{replica_id}"
    try:
        return disk_stage_dir(replica_id)
    except ValueError as exc:
        raise ValueError(
            f"/dev/shm has no room for the stage ({SHM_DIR} free: not"
            f" {(2 * needed_bytes + SPACE_MARGIN_BYTES) >> 20} MiB) and {exc}"
        ) from None


def disk_stage_dir(replica_id: str) -> Path:
    """``$XDG_CACHE_HOME/rollout-service/stage/<replica>`` (``XDG_CACHE_HOME`` defaults to
    ``~/.cache``): the default stage without /dev/shm, and the one a default /dev/shm stage moves
    to when a step does not fit there. ``ValueError`` when there is no home directory for it."""
    cache = os.environ.get("XDG_CACHE_HOME", "").strip()
    if not cache:
        try:
            cache = str(Path.home() / ".cache")
        except RuntimeError:  # a user id with no home (no passwd entry, HOME unset)
            raise ValueError(
                "there is no home directory for the stage's local-disk default: pass --stage-dir with a"
                " node-local folder (or set XDG_CACHE_HOME)"
            ) from None
    return Path(cache) / "rollout-service" / "stage" / replica_id


class _NoRoom(StageError):
    """A step does not fit a stage that may move (:meth:`Stage._move`): caught there, never seen
    outside (when the move fails, ``original``, the error the stage would have raised, is)."""

    def __init__(self, original: Exception):
        super().__init__(str(original))
        self.original = original


class Stage:
    """One replica's staging directory.

    ``fallback``: for a stage the user did not choose (the default in /dev/shm), the local-disk
    folder it moves to when a step does not fit (:meth:`_move`); None: it stays where it is."""

    def __init__(self, path: Path, *, fallback: Path | None = None, max_bytes: int | None = None):
        self.path = Path(path)
        self._fallback = None if fallback is None else Path(fallback)
        self.max_bytes = max_bytes
        """The most the stage may hold (``--stage-max-gb``), below its file system's room; None: no limit."""
        self._left: Path | None = None
        """The stage this one moved from, still holding the copy SGLang serves, until :meth:`prune`
        (a load from the new folder) or :meth:`remove` removes it."""
        self._left_lock = -1
        self._spare: Path | None = None
        """A copy nobody serves any more, whose files the next copy or rebuild writes over."""
        self._finite: collections.OrderedDict[str, None] = collections.OrderedDict()
        """Names of the copies this process checked whole for NaN/Inf (:meth:`mark_finite`): only
        such a copy lets a rebuild on it, or its reuse, skip the whole check. A copy found here
        after a restart may have been renamed into place by a process killed before its check."""
        self._lock = -1
        self._open()

    def mark_finite(self, path: Path) -> None:
        """Record that the copy at ``path`` holds no NaN/Inf in any tensor (checked by the caller)."""
        self._finite[path.name] = None
        self._finite.move_to_end(path.name)
        while len(self._finite) > MAX_FINITE_MARKS:
            self._finite.popitem(last=False)

    def _known_finite(self, path: Path) -> bool:
        return path.name in self._finite

    def _open(self) -> None:
        """Make (or adopt) the folder, check it is this user's, take its lock, clear leftovers.
        A link at its path (this user's or root's, to a folder that passes the same check) is
        resolved here, once: ``path`` becomes the folder it points to."""
        named = self.path
        with shm_stages_held(named):  # no sibling reclaims this folder meanwhile
            try:
                named.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StageError(
                    f"cannot create the stage directory {named}: {exc.strerror}; pass a writable node-local --stage-dir"
                ) from None
            self.path = resolve_stage_path(named)
            check_owner(self.path)
            check_is_stage(self.path)  # before anything is written in it
            self._lock = take_lock(self.path)
            try:
                mark_as_stage(self.path)
                close_to_others(self.path)  # (only a folder that is the stage's: never one refused)
                self._clear_leftovers()
            except BaseException:
                self._unlock()
                raise
            if is_default_shm_stage(named):
                reclaim_shm_leftovers(named)

    def _clear_leftovers(self) -> None:
        """Remove the hidden work (``.tmp-*``) a killed sidecar left."""
        try:
            for entry in self.path.iterdir():
                if entry.name.startswith(TEMP_PREFIX):
                    remove_entry(entry)
        except (OSError, RecursionError) as exc:
            raise StageError(
                f"cannot clear what a killed sidecar left in the stage directory {self.path}"
                f" ({type(exc).__name__}: {exc}); remove its {TEMP_PREFIX}* entries, or pass another --stage-dir"
            ) from None

    def _ensure_held(self) -> None:
        """The folder and the lock this sidecar holds are still there. A cleaner that removed them
        (a ``/dev/shm`` sweeper, systemd-logind's ``RemoveIPC=yes`` at the user's logout, a
        person) left the stage unusable and unlocked, so that a second sidecar could take it over:
        they are made and locked again (``StageError`` when another sidecar holds it by then)."""
        try:
            held = os.fstat(self._lock)
            there = os.lstat(self.path / LOCK_NAME)
            if (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino):
                return
        except OSError:
            pass
        log.warning(
            "the stage directory %s or its lock file was removed while this sidecar ran (a /dev/shm"
            " cleaner, or systemd-logind's RemoveIPC=yes?); making and locking it again",
            self.path,
        )
        self._unlock()
        self._spare = None
        self._open()

    def close(self) -> None:
        """Remove the stage's hidden work and release its locks (idempotent). The staged copies
        stay (a restarted sidecar adopts the one SGLang serves); the hidden ``.tmp-*`` work (the
        spare copy, a copy or removal cut short) is of no use to anyone after this process (the
        next start removes it) and in /dev/shm holds up to a model's worth of RAM until then."""
        if self._lock >= 0:
            self._spare = None
            for entry in self._hidden_work():
                try:
                    remove_entry(entry)
                except OSError as exc:
                    log.warning("could not remove %s from the stage (the next start does): %s", entry, exc)
        self._unlock()
        if self._left_lock >= 0:
            os.close(self._left_lock)
            self._left_lock = -1

    def _hidden_work(self) -> list[Path]:
        """The stage's hidden ``.tmp-*`` entries ([] when the folder cannot be listed)."""
        try:
            return [e for e in self.path.iterdir() if e.name.startswith(TEMP_PREFIX)]
        except OSError:
            return []

    def _unlock(self) -> None:
        """Release the stage's own lock (idempotent)."""
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1

    def remove(self) -> int:
        """Delete what the stage made, and its directory once empty, once nothing will read it
        again (``serve`` stopped SGLang): a stage in /dev/shm is RAM until someone deletes it.
        Returns the bytes freed. Works after :meth:`close` too: the lock is taken again first,
        and a stage another sidecar locked meanwhile is left alone (``StageError``). Entries
        the stage did not make stay, and so does the directory then. The stage this one moved
        from (:meth:`_move`), if still there, is removed too."""
        self.close()
        freed = 0
        left, self._left = self._left, None
        if left is not None:
            try:
                freed += _remove_unheld(left)
            except (OSError, StageError) as exc:
                log.warning("could not remove %s, the stage this sidecar moved from: %s", left, exc)
        return freed + _remove_unheld(self.path)

    def prune(self, keep: set[Path], *, keep_spare: bool = True) -> None:
        """Remove staged copies other than ``keep`` (the one SGLang serves); one of them may
        stay as the spare (see the module's docstring) unless ``keep_spare`` is False. Only the
        stage's own copies and work are looked at: nothing else in the folder is touched."""
        self._ensure_held()
        keep_real = {Path(os.path.realpath(p)) for p in keep}
        if self._left is not None and Path(os.path.realpath(self._left)) not in {p.parent for p in keep_real}:
            self._drop_left()
        for entry in self.path.iterdir():
            if not is_work_name(entry.name) or (keep_spare and entry == self._spare):
                continue
            if Path(os.path.realpath(entry)) not in keep_real:
                try:
                    if keep_spare:
                        self._retire(entry)
                    else:
                        remove_entry(entry)
                except OSError as exc:  # the others are still removed; this one at the next prune
                    log.warning("could not remove %s from the stage (tried again at the next prune): %s", entry, exc)
        if not keep_spare:
            self._spare = None

    def _drop_left(self) -> None:
        """Remove the stage this one moved from (:meth:`_move`) and release its lock: nothing is
        served from it any more, and in /dev/shm its copies are RAM."""
        left, lock = self._left, self._left_lock
        assert left is not None
        self._left, self._left_lock = None, -1
        try:
            freed = empty_stage(left) if lock >= 0 else _remove_unheld(left)
        except (OSError, StageError) as exc:
            log.warning("could not remove %s, the stage this sidecar moved from: %s; delete it by hand", left, exc)
        else:
            log.info("removed %s, the stage this sidecar moved from (%.1f MB freed)", left, freed / 1e6)
        finally:
            if lock >= 0:
                os.close(lock)

    def prune_before_first_load(self, served: str | None) -> None:
        """Prune as a sidecar that has loaded nothing yet must: beside the copy SGLang serves
        (``served``, its model path), keep the newest copy of a later step. A sidecar killed
        mid-load may have handed SGLang that copy, and SGLang reports a load's path only once the
        load is done, opening the shards one after another meanwhile: removed or written over,
        they would fail the load, which kills SGLang. This sidecar's own first load ends after
        any such load (SGLang runs weight updates one at a time) and then prunes the rest."""
        self._ensure_held()
        served_path = Path(served) if served and self.owns(served) else None
        served_step = _copy_step(served_path) if served_path is not None else None
        later = [
            (step, entry)
            for entry in self.path.iterdir()
            if (step := _copy_step(entry)) is not None and (served_step is None or step > served_step)
        ]
        keep = {served_path} if served_path is not None else set()
        if later:
            keep.add(max(later)[1])
        self.prune(keep)

    def _retire(self, path: Path) -> None:
        """A staged copy nobody will load again: keep it as the spare when there is none and
        the file system would still have room for another copy, else remove it."""
        if self._spare is not None or path.name.startswith(TEMP_PREFIX) or not path.is_dir() or path.is_symlink():
            remove_entry(path)
            return
        try:
            size = bytes_under(path)
            roomy = self._free() >= size + SPACE_MARGIN_BYTES
            if roomy:
                spare = self.path / f"{SPARE_PREFIX}{uuid.uuid4().hex[:8]}"
                os.rename(path, spare)
                self._spare = spare
                return
        except OSError:
            pass
        remove_entry(path)

    def _fill_from_spare(self, tmp: Path, names: list[str]) -> None:
        """Move the spare's files of these names into the new folder ``tmp`` (to be written
        over, every byte) and remove the rest of the spare."""
        spare, self._spare = self._spare, None
        if spare is None:
            return
        try:
            for name in names:
                old = spare / name
                if reusable_file(old):
                    os.rename(old, tmp / name)
        except OSError as exc:  # a spare is only a saving: go on without it
            log.debug("the stage's spare copy %s could not be reused: %s", spare, exc)
        finally:
            remove_entry(spare)

    def owns(self, path: str | Path | None) -> bool:
        """Whether ``path`` is an entry of this stage (or of the one it moved from, while kept)."""
        if not path:
            return False
        parent = Path(os.path.realpath(path)).parent
        return any(parent == Path(os.path.realpath(p)) for p in (self.path, self._left) if p is not None)

    def usage_bytes(self) -> int:
        """Bytes of the files in the stage (staged copies and work in progress)."""
        return bytes_under(self.path)

    def find(self, step: int, fingerprint: str) -> tuple[Path, Manifest] | None:
        """The staged full copy of the publication with this fingerprint, if one is here. Only a
        copy of this user's alone is (:func:`~.stage_folder.foreign_copy`): a link, another user's
        folder or file, or one others may write, is never reused nor rebuilt from (it is replaced
        when the copy is made again), whatever its bytes are now."""
        path = self._name_for(step, fingerprint)
        try:
            why = foreign_copy(path)
        except FileNotFoundError:
            return None
        if why is not None:
            log.warning(
                "%s in the stage directory %s is not used as a staged copy: %s (put there, or changed, by"
                " another user?); the step is staged anew",
                path.name,
                self.path,
                why,
            )
            return None
        try:
            manifest = Manifest.load(path, root=self.path)
        except OSError:
            raise  # the stage's own disk failing a read (UnreadableFile): its fault, not a missing copy
        except CheckpointError:
            return None
        if manifest.source_fingerprint() != fingerprint or manifest.step != step:
            return None
        return path, manifest

    def _name_for(self, step: int, fingerprint: str) -> Path:
        return self.path / f"{step_dir_name(step)}-{fingerprint[:12]}"

    # --- room ------------------------------------------------------------------------------
    def _free(self) -> int:
        """Bytes free for the stage now: its file system's free space, within ``max_bytes``."""
        free = shutil.disk_usage(self.path).free
        if self.max_bytes is not None:
            free = min(free, max(0, self.max_bytes - self.usage_bytes()))
        return free

    def _room(self) -> tuple[int, int]:
        """(bytes a new copy may take, bytes the stage may hold at all): the free space plus the
        spare's bytes, since the next copy writes over the spare's files or drops it; both within
        ``max_bytes``."""
        total = shutil.disk_usage(self.path).total
        if self.max_bytes is not None:
            total = min(total, self.max_bytes)
        spare = self._spare
        spare_bytes = bytes_under(spare) if spare is not None and spare.is_dir() else 0
        return self._free() + spare_bytes, total

    def _check_room(self, manifest_step: int, nbytes: int, *, peak: int | None = None, why: str = "") -> None:
        """Room for the new copies of step ``manifest_step``: ``nbytes`` is its largest copy,
        ``peak`` what the build holds at once (default: that one copy; a chain holds two, see
        :meth:`_check_chain_room`; ``why`` says so in the error). A copy larger than the whole stage is
        rejected (``too_large_for_stage``: its manifest lists more than this host can hold);
        one that only needs room freed is a ``StageError`` (the sync is tried again)."""
        need = (nbytes if peak is None else peak) + SPACE_MARGIN_BYTES
        free, total = self._room()
        if nbytes + SPACE_MARGIN_BYTES > total:
            self._no_room(
                CheckpointError(
                    "too_large_for_stage",
                    f"step {manifest_step} needs {(nbytes + SPACE_MARGIN_BYTES) >> 20} MiB in the stage, more than the"
                    f" {total >> 20} MiB the stage may hold (its file system, or --stage-max-gb): its manifest lists"
                    " files larger than the model (or give --stage-dir a file system with room for two copies of"
                    " the model)",
                )
            )
        if free < need:
            room = (
                "two copies of the model"
                if peak is None
                else "three copies of the model, or wait for the next full step"
            )
            self._no_room(
                StageError(
                    f"the stage directory {self.path} has {free >> 20} MiB free (its spare copy counted), step"
                    f" {manifest_step} needs {need >> 20} MiB{why}: give --stage-dir a folder with room for {room}"
                )
            )

    def _no_room(self, exc: Exception) -> NoReturn:
        """Raise ``exc`` (no room for a step); in a stage that may move, ``_NoRoom`` saying why."""
        if self._fallback is not None:
            raise _NoRoom(exc) from None
        raise exc

    def _moving(self, make: Callable[[], T]) -> T:
        """``make()``; when the step does not fit a stage that may move, move it (:meth:`_move`)
        and ``make()`` there, from the start: nothing of the step was written yet."""
        try:
            return make()
        except _NoRoom as exc:
            try:
                self._move(str(exc))
            except StageError as failed:  # the step is judged as where it is: rejected, or tried again
                log.warning("%s", failed)
                raise exc.original from None
        return make()

    def _move(self, why: str) -> None:
        """Move to the local-disk ``fallback``: a step does not fit the default /dev/shm stage
        (``why``), which the user did not choose, and would be refused there for good. Every copy
        is made in the new folder from now on (a delta whose base was staged in the old one is
        replayed from its full step). The old folder stays locked, holding the copy SGLang serves,
        until a load from the new one (:meth:`prune`) or :meth:`remove` removes it; its spare
        copy goes now. Logged once: a stage moves at most once."""
        target = self._fallback
        assert target is not None
        old_path, old_lock = self.path, self._lock
        reference = None
        with contextlib.suppress(StageError):
            reference = self.load_reference()
        self.path, self._lock = target, -1
        try:
            self._open()
        except (OSError, StageError) as exc:
            self.path, self._lock = old_path, old_lock
            raise StageError(f"{why}; and the stage's local-disk default {target} cannot be used: {exc}") from None
        spare, self._spare = self._spare, None
        self._fallback, self._left, self._left_lock = None, old_path, old_lock
        self._finite.clear()  # names of copies checked in the old folder, not of those here
        with contextlib.suppress(OSError):
            if spare is not None:
                remove_entry(spare)
        with contextlib.suppress(OSError, StageError):  # it is learnt again otherwise
            if reference is not None:
                self.save_reference(*reference)
        log.warning(
            "%s. No --stage-dir was given, so the stage moves to %s (the default when /dev/shm has no room)"
            " and stages every step there from now on; %s is removed once a step loads from there. Pass"
            " --stage-dir to choose the stage's folder",
            why,
            self.path,
            old_path,
        )

    def _check_chain_room(self, chain: Chain) -> None:
        """Room for the whole chain, before anything is written: the copies made here are the
        chain's full step (when it is not staged) and one per delta; each delta is applied to the
        copy before it, which is dropped once the next is complete, so at most two are held at
        once beside the copies already staged (the served one among them)."""
        sizes = [] if chain.start_is_staged else [chain.start.manifest.total_bytes]
        sizes += [_files_bytes(link.manifest.delta.target_files) for link in chain.deltas if link.manifest.delta]
        if not sizes:
            return
        target = chain.deltas[-1].manifest.step if chain.deltas else chain.start.manifest.step
        if len(sizes) == 1:
            self._check_room(target, sizes[0])
            return
        peak = max(a + b for a, b in zip(sizes, sizes[1:]))
        start = f"the staged copy of step {chain.start.manifest.step}" if chain.start_is_staged else "its full step"
        self._check_room(
            target,
            max(sizes),
            peak=peak,
            why=f": it is rebuilt by applying {len(chain.deltas)} deltas in turn to {start}, each to the copy the"
            " one before made, so it holds two new copies at once beside the copy SGLang serves",
        )

    # --- building copies -------------------------------------------------------------------
    @contextlib.contextmanager
    def _stage_faults(self, what: str) -> Iterator[None]:
        """An ``OSError`` the stage's file system caused becomes a ``StageError`` (the controller
        reports ``stage_failed`` and tries the step again) instead of rejecting the step.

        The copy and rebuild code (``untrusted_files.copy_verified``, ``delta_apply.reconstruct``)
        reads the untrusted root and writes the stage in the same calls, and its write calls
        (``write``, ``pwrite``, ``ftruncate``) raise ``OSError``s that name no file. So the fault is
        told by the error itself, see :meth:`_is_stage_fault`: an error naming a path in the stage
        (``mkdir``, ``open``, ``rename``), an error only a write can raise (``ENOSPC``, ``EDQUOT``,
        ``EROFS``, ``EFBIG``: reading the root never raises them), or an ``EIO`` naming no file when
        the stage itself cannot write and sync a page any more. Anything else, reading the root
        included (its ``EIO`` when the stage still writes), stays the checkpoint's to answer for.
        """
        try:
            yield
        except OSError as exc:
            if not self._is_stage_fault(exc):
                raise
            where = f" ({exc.filename})" if exc.filename else ""
            raise StageError(
                f"{what}: writing in the stage directory {self.path} failed{where}:"
                f" {exc.strerror or exc}; free room there or give --stage-dir a writable node-local"
                " folder with room for the copies (the step is tried again)"
            ) from exc

    def _is_stage_fault(self, exc: OSError) -> bool:
        """Whether ``exc`` came from the stage's file system (see :meth:`_stage_faults`)."""
        names = [n for n in (exc.filename, exc.filename2) if isinstance(n, (str, bytes, os.PathLike))]
        if names:
            return any(is_inside(os.fsdecode(n), self.path) for n in names)
        if exc.errno in WRITE_ONLY_ERRNOS:
            return True
        return exc.errno == errno.EIO and not self._can_write()

    def _can_write(self) -> bool:
        """Whether a page can still be written and synced in the stage (a probe, removed at once)."""
        probe = self.path / f"{TEMP_PREFIX}probe-{uuid.uuid4().hex[:8]}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, bytes(PROBE_BYTES))
                os.fsync(fd)
            finally:
                os.close(fd)
            return True
        except OSError:
            return False
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()

    def build(
        self, root: Path, source_dir: Path, manifest: Manifest, deadline: Deadline, *, check_finite: bool = False
    ) -> StagedBuild:
        """A verified full copy of a published step here: the copy already staged (every byte
        checked again), or copied (full) or rebuilt (delta).

        ``check_finite`` makes a rebuild refuse NaN/Inf in the tensors a delta changes (a full
        copy is checked by validating it afterwards). The stage's own failures (no room, a
        write that fails) raise ``StageError``; the checkpoint's, ``CheckpointError``. A step
        that does not fit a stage that may move is built where it moves to (:meth:`_move`)."""
        return self._moving(lambda: self._build(root, source_dir, manifest, deadline, check_finite))

    def _build(
        self, root: Path, source_dir: Path, manifest: Manifest, deadline: Deadline, check_finite: bool
    ) -> StagedBuild:
        t0 = time.perf_counter()
        self._ensure_held()
        with self._stage_faults(f"staging {source_dir.name}"):
            staged = self._reuse(manifest, deadline)
            if staged is not None:  # its bytes checked again; NaN/Inf only if this process checked it
                return StagedBuild(
                    staged, manifest.kind, 0, time.perf_counter() - t0, 0, check_finite and self._known_finite(staged)
                )
            if manifest.kind != "delta":
                path = self._copy_in(root, source_dir, manifest, deadline)
                return StagedBuild(path, manifest.kind, manifest.total_bytes, time.perf_counter() - t0, 0)
            link = ChainLink(source_dir, manifest)
            chain = resolve_chain(root, link, self.find, deadline)
            try:
                return self._apply_chain(root, chain, deadline, t0, check_finite)
            except CheckpointError as exc:
                if not chain.start_is_staged or not (
                    exc.reason == "base_mismatch" or self._damaged(chain.start, deadline)
                ):
                    raise
                log.warning(
                    "the staged copy %s is damaged (%s); replaying the chain from its full step",
                    chain.start.path.name,
                    exc,
                )
                remove_entry(chain.start.path)
                return self._apply_chain(root, resolve_chain(root, link, None, deadline), deadline, t0, check_finite)

    def _damaged(self, start: ChainLink, deadline: Deadline) -> bool:
        """Whether the staged copy ``start`` no longer holds the bytes its manifest lists (every
        byte read). A delta refused with another reason than ``base_mismatch`` (a header or a
        layout that does not parse: a copy a host crash left with zeroed blocks) may be refused
        for its base's sake: then the chain is replayed, not the step rejected."""
        try:
            _check_copy(self.path, start.path, start.manifest, start.manifest.files, deadline)
        except CheckpointError as exc:
            if exc.reason == "validation_timeout":
                raise
            return True
        return False

    def _reuse(self, manifest: Manifest, deadline: Deadline) -> Path | None:
        """The copy of this very publication staged before (a re-sync after SGLang restarted),
        when every byte of it still matches; else None (a copy that does not is removed).

        A staged copy is trusted as a chain base is: its manifest must stand for this
        publication (:meth:`find`), and its bytes are checked against digests as they are read.
        Here nothing is rebuilt from it, so every file is read whole and its digest checked
        against the files the *published* manifest describes (a delta's ``target_files``), and
        the folder must hold those files and the manifest only (SGLang loads the whole folder)."""
        found = self.find(manifest.step, manifest.fingerprint())
        if found is None:
            return None
        path, staged = found
        try:
            _check_copy(self.path, path, staged, _published_files(manifest), deadline)
        except CheckpointError as exc:
            if exc.reason == "validation_timeout":
                raise
            log.warning("the staged copy %s is damaged (%s: %s); staging it anew", path.name, exc.reason, exc)
            remove_entry(path)
            return None
        log.info("%s is staged already and every byte of it checked: no copy from shared storage", path.name)
        return path

    def _apply_chain(self, root: Path, chain: Chain, deadline: Deadline, t0: float, check_finite: bool) -> StagedBuild:
        """Copy in the chain's full step (unless a staged copy starts it) and apply its deltas in
        turn. Each copy made here is dropped (or kept as the spare) once the next is complete;
        on failure the one held is removed, so a retry finds the room it found the first time."""
        self._check_chain_room(chain)
        bytes_read = 0
        made: Path | None = None
        """The copy made here that the next delta is applied to (none while a staged copy is)."""
        try:
            if chain.start_is_staged:
                current = chain.start
            else:
                made = self._copy_in(root, chain.start.path, chain.start.manifest, deadline)
                bytes_read += chain.start.manifest.total_bytes
                current = ChainLink(made, Manifest.load(made, root=self.path))
            for link in chain.deltas:
                current = self._apply_link(root, link, current, deadline, check_finite)
                bytes_read += link.manifest.total_bytes
                previous, made = made, current.path
                if previous is not None:  # an intermediate version nobody serves: the next needs only `current`
                    self._retire(previous)
        except BaseException:
            if made is not None:
                remove_entry(made)
            raise
        # A copied-in full step was not checked for NaN/Inf (only its digests), nor a staged copy
        # this process did not check (one renamed into place before a crash): the tensors no delta
        # changed are that copy's, so the caller then checks the whole rebuilt copy.
        checked = check_finite and chain.start_is_staged and self._known_finite(chain.start.path)
        return StagedBuild(current.path, "delta", bytes_read, time.perf_counter() - t0, len(chain.deltas), checked)

    def _apply_link(
        self, root: Path, link: ChainLink, current: ChainLink, deadline: Deadline, check_finite: bool
    ) -> ChainLink:
        """Rebuild ``link`` (a delta) from ``current`` (the copy of its base) into its own copy here."""
        final = self._name_for(link.manifest.step, link.manifest.fingerprint())
        self._clear_name(final)  # a copy from an earlier try (or anything else there): rebuild it
        tmp = self._work_folder(final)
        try:
            delta = link.manifest.delta
            assert delta is not None
            self._fill_from_spare(tmp, sorted(delta.target_files))
            rebuilt = reconstruct(root, link, current, self.path, tmp, deadline, check_finite=check_finite)
            seal_copy(tmp)
            os.rename(tmp, final)
        except BaseException:
            remove_entry(tmp)
            raise
        return ChainLink(final, rebuilt)

    def _work_folder(self, final: Path) -> Path:
        """A new hidden folder to make the copy ``final`` in (renamed to it once verified), never
        writable by the group whatever the umask."""
        tmp = self.path / f"{TEMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(mode=WORK_FOLDER_MODE)
        return tmp

    def _clear_name(self, final: Path) -> None:
        """Remove whatever is at ``final``, the name a copy is about to take; ``StageError`` saying
        whose it is when it cannot be removed (another user's, in a stage folder others may write)."""
        if not os.path.lexists(final):
            return
        try:
            remove_entry(final)
        except PermissionError as exc:
            try:
                owner: int | None = os.lstat(final).st_uid
            except OSError:
                owner = None
            whose = (
                f": it belongs to user id {owner}, not to this sidecar's" if owner not in (None, os.geteuid()) else ""
            )
            raise StageError(
                f"{final} is where the stage makes the copy of this step, and it cannot be removed"
                f" ({exc.strerror or exc}){whose}; remove it, or pass a --stage-dir of this user's"
            ) from None

    def copy_in(self, root: Path, source_dir: Path, manifest: Manifest, deadline: Deadline) -> Path:
        """Copy the checkpoint's files here, verifying sizes and digests; return the copy.
        A failing write in the stage raises ``StageError`` (see :meth:`_stage_faults`); a
        step that does not fit a stage that may move is copied where it moves to."""
        return self._moving(lambda: self._copy_in(root, source_dir, manifest, deadline))

    def _copy_in(self, root: Path, source_dir: Path, manifest: Manifest, deadline: Deadline) -> Path:
        with self._stage_faults(f"copying {source_dir.name}"):
            self._check_room(manifest.step, manifest.total_bytes)
            final = self._name_for(manifest.step, manifest.fingerprint())
            self._clear_name(final)  # a copy of the same bytes from an earlier try (or anything else): redo it
            tmp = self._work_folder(final)
            try:
                self._fill_from_spare(tmp, sorted(manifest.files))
                for fname, entry in sorted(manifest.files.items()):
                    where = f"{source_dir.name}/{fname}"
                    copy_verified(
                        root,
                        source_dir / fname,
                        tmp / fname,
                        where=where,
                        size=entry.size,
                        digest=entry.digest,
                        deadline=deadline,
                    )
                (tmp / MANIFEST_NAME).write_text(manifest.as_copy().to_json())
                seal_copy(tmp)
                os.rename(tmp, final)
            except BaseException:
                remove_entry(tmp)
                raise
            return final

    # --- the served model's reference ----------------------------------------------------
    def save_reference(self, specs: TensorSpecs, source: str) -> None:
        self._ensure_held()
        data = {"source": source, "tensors": {k: [dt, list(shape)] for k, (dt, shape) in specs.items()}}
        dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            atomic_replace(dir_fd, REFERENCE_NAME, json.dumps(data, sort_keys=True).encode())
        finally:
            os.close(dir_fd)

    def load_reference(self) -> tuple[TensorSpecs, str] | None:
        """The reference kept in the stage, or None when there is none (or it does not parse:
        it is learnt again). A ``reference.json`` that is not a small regular file (a FIFO would
        block the reader for good) raises ``StageError`` naming it."""
        path = self.path / REFERENCE_NAME
        try:
            raw = read_small(self.path, path, where=str(path))
        except CheckpointError as exc:
            if exc.reason == "missing_file":
                return None
            if isinstance(exc, OSError):  # UnreadableFile: the stage's disk failed the read
                raise StageError(f"cannot read {path}: {exc}; check the stage directory's disk") from None
            raise StageError(
                f"cannot read {path} ({exc.reason}): the stage keeps a small regular file there;"
                " remove what is there (the reference is learnt again)"
            ) from None
        try:
            data = json.loads(raw)
            specs = {str(k): (str(v[0]), tuple(int(x) for x in v[1])) for k, v in data["tensors"].items()}
            return specs, str(data.get("source"))
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return None


def _remove_unheld(path: Path) -> int:
    """Take the lock of the stage folder ``path`` (one this process no longer holds) and empty it
    (:func:`empty_stage`): the bytes freed, 0 when it is gone. ``StageError`` when another
    sidecar holds it (left in place)."""
    try:
        lock = open_own_file(path / LOCK_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND, "lock")
    except FileNotFoundError:
        return 0
    except OSError as exc:
        raise StageError(f"cannot open {path / LOCK_NAME}: {exc.strerror}; left {path} in place") from None
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StageError(f"another sidecar uses the stage directory {path} now; left it in place") from None
        return empty_stage(path)
    finally:
        os.close(lock)


def _copy_step(path: Path) -> int | None:
    """The step of a staged copy's name (``step-XXXXXXXX-<fingerprint>``), None for any other name."""
    return parse_step_dir_name(path.name[: -len("-") - 12]) if COPY_NAME_RE.match(path.name) else None


def _published_files(manifest: Manifest) -> dict[str, FileEntry]:
    """The files of the full checkpoint a published manifest stands for (a delta's targets)."""
    if manifest.kind == "delta" and manifest.delta is not None:
        return manifest.delta.target_files
    return manifest.files


def _files_bytes(files: dict[str, FileEntry]) -> int:
    return sum(e.size for e in files.values())


def _check_copy(stage_dir: Path, path: Path, staged: Manifest, files: dict[str, FileEntry], deadline: Deadline) -> None:
    """``CheckpointError`` unless the staged copy ``path`` holds exactly ``files`` (and its
    manifest), each a regular file whose digest is the one listed."""
    if {n: (e.size, e.digest) for n, e in staged.files.items()} != {n: (e.size, e.digest) for n, e in files.items()}:
        raise CheckpointError("base_mismatch", f"{path.name}'s manifest lists other files than were published")
    found = {e.name for e in os.scandir(path)}
    if found != set(files) | {MANIFEST_NAME}:
        odd = sorted(found ^ (set(files) | {MANIFEST_NAME}))[:5]
        raise CheckpointError("base_mismatch", f"{path.name} holds other files than its manifest lists ({odd})")
    for fname, entry in sorted(files.items()):
        read_every_byte(stage_dir, path / fname, f"{path.name}/{fname}", entry.digest, True, False, deadline)
