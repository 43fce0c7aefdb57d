"""Node-local staging: SGLang loads only bytes the sidecar copied and verified itself.

Validating files on shared storage and then letting SGLang open them leaves a window in
which a writer can change them (time of check to time of use). The sidecar therefore
copies each published checkpoint into a directory only it writes (``--stage-dir``:
``/dev/shm`` when it has room, else a local folder), checks every byte of the copy against
the manifest's digests as it copies, validates the copy (headers, reference, finiteness),
and hands SGLang the copy. A copy becomes visible under its final name only by an atomic
rename, so a sidecar killed mid-copy leaves a hidden ``.tmp-*`` folder that the next start
removes. The stage holds the served copy, at most one being prepared, and a spare (below).

A ``delta`` step is rebuilt here (:meth:`Stage.build`): applied to the staged copy of its
base while SGLang keeps serving that copy, every tensor and file checked against the digests
of the full checkpoint it stands for, renamed into place only when complete. A sidecar that
has no copy of the base (a restart with an emptied stage, a late joiner) replays the chain
from its full step; a missing or corrupt link rejects the step with a reason. Staged copies
are named ``step-XXXXXXXX-<fingerprint>`` after the *published* manifest they stand for.

A copy that stops being served is kept as a hidden *spare* (one at most, and only while the
stage's file system would still have room for another copy): the next copy or rebuild writes
over its files instead of new ones. On tmpfs, filling fresh pages costs more than the copy
itself (1.6 GB/s against 5 GB/s for writing over existing ones, measured on the CPU test bed),
so this roughly halves what staging a version costs there. The spare is named ``.tmp-*``: a
restart removes it. Its bytes are never trusted: every byte written over them is checked
against the published digests like any other.

The stage also keeps ``reference.json``: the tensor names, shapes and dtypes of the model
SGLang serves, learnt at the first load, so a restarted sidecar checks against the same
reference.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint_format import MANIFEST_NAME, TEMP_PREFIX, CheckpointError, Manifest, step_dir_name
from ..checkpoint_reader import TensorSpecs
from ..delta_apply import Chain, ChainLink, reconstruct, resolve_chain
from ..protocol import atomic_replace
from ..untrusted_files import Deadline, copy_verified

log = logging.getLogger(__name__)

REFERENCE_NAME = "reference.json"
LOCK_NAME = ".lock"
SPARE_PREFIX = f"{TEMP_PREFIX}spare-"
SPACE_MARGIN_BYTES = 64 << 20


class StageError(RuntimeError):
    """The stage itself failed (no room, not writable): not the checkpoint's fault."""


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


SHM_MIN_FREE_BYTES = 8 << 30
"""/dev/shm is chosen by default only when this much is free (a container's default /dev/shm
is 64 MiB; two copies of a 7B bf16 model need ~30 GB)."""


def default_stage_dir(replica_id: str, needed_bytes: int = SHM_MIN_FREE_BYTES // 2) -> Path:
    """``/dev/shm/rollout-stage-<replica>`` when /dev/shm has room for two copies of
    ``needed_bytes``, else ``$XDG_CACHE_HOME/rollout-service/stage/<replica>`` (``XDG_CACHE_HOME``
    defaults to ``~/.cache``)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        try:
            free = shutil.disk_usage(shm).free
        except OSError:
            free = 0
        if free > 2 * needed_bytes + SPACE_MARGIN_BYTES:
            return shm / f"rollout-stage-{replica_id}"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "rollout-service" / "stage" / replica_id


class Stage:
    """One replica's staging directory."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StageError(
                f"cannot create the stage directory {self.path}: {exc.strerror}; pass a writable node-local --stage-dir"
            ) from None
        try:
            self._lock = open(self.path / LOCK_NAME, "a")
        except OSError as exc:
            raise StageError(
                f"cannot open {self.path / LOCK_NAME}: {exc.strerror} (left by a sidecar run as another user?);"
                " pass a node-local --stage-dir this sidecar owns, or remove that one"
            ) from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise StageError(
                f"another sidecar uses the stage directory {self.path}: give each"
                " replica its own --stage-dir (or --replica-id)"
            ) from None
        try:
            for entry in self.path.iterdir():
                if entry.name.startswith(TEMP_PREFIX):
                    _remove(entry)
        except (OSError, RecursionError) as exc:
            self._lock.close()
            raise StageError(
                f"cannot clear what a killed sidecar left in the stage directory {self.path}"
                f" ({type(exc).__name__}: {exc}); remove its {TEMP_PREFIX}* entries, or pass another --stage-dir"
            ) from None
        self._spare: Path | None = None
        """A copy nobody serves any more, whose files the next copy or rebuild writes over."""

    def close(self) -> None:
        self._lock.close()

    def remove(self) -> int:
        """Delete the stage directory with everything in it, once nothing will read it again
        (``serve`` stopped SGLang): a stage in /dev/shm is RAM until someone deletes it.
        Returns the bytes freed. Works after :meth:`close` too: the lock is taken again first,
        and a stage another sidecar locked meanwhile is left alone (``StageError``)."""
        self._lock.close()
        try:
            lock = open(self.path / LOCK_NAME, "a")
        except FileNotFoundError:
            return 0
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StageError(
                    f"another sidecar uses the stage directory {self.path} now; left it in place"
                ) from None
            freed = self.usage_bytes()
            for entry in self.path.iterdir():
                if entry.name != LOCK_NAME:
                    _remove(entry)
            (self.path / LOCK_NAME).unlink()  # while still held: nobody locks a file about to vanish
        finally:
            lock.close()
        with contextlib.suppress(OSError):  # not empty: someone's new file; leave it
            self.path.rmdir()
        return freed

    def prune(self, keep: set[Path], *, keep_spare: bool = True) -> None:
        """Remove staged copies other than ``keep`` (the one SGLang serves); one of them may
        stay as the spare (see the module's docstring) unless ``keep_spare`` is False."""
        keep_real = {Path(os.path.realpath(p)) for p in keep}
        for entry in self.path.iterdir():
            if entry.name in (REFERENCE_NAME, LOCK_NAME) or (keep_spare and entry == self._spare):
                continue
            if Path(os.path.realpath(entry)) not in keep_real:
                if keep_spare:
                    self._retire(entry)
                else:
                    _remove(entry)
        if not keep_spare:
            self._spare = None

    def _retire(self, path: Path) -> None:
        """A staged copy nobody will load again: keep it as the spare when there is none and
        the file system would still have room for another copy, else remove it."""
        if self._spare is not None or path.name.startswith(TEMP_PREFIX) or not path.is_dir() or path.is_symlink():
            _remove(path)
            return
        try:
            size = sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(path))
            roomy = shutil.disk_usage(self.path).free >= size + SPACE_MARGIN_BYTES
            if roomy:
                spare = self.path / f"{SPARE_PREFIX}{uuid.uuid4().hex[:8]}"
                os.rename(path, spare)
                self._spare = spare
                return
        except OSError:
            pass
        _remove(path)

    def _fill_from_spare(self, tmp: Path, names: list[str]) -> None:
        """Move the spare's files of these names into the new folder ``tmp`` (to be written
        over, every byte) and remove the rest of the spare."""
        spare, self._spare = self._spare, None
        if spare is None:
            return
        try:
            for name in names:
                old = spare / name
                if old.is_file() and not old.is_symlink():
                    os.rename(old, tmp / name)
        except OSError as exc:  # a spare is only a saving: go on without it
            log.debug("the stage's spare copy %s could not be reused: %s", spare, exc)
        finally:
            _remove(spare)

    def owns(self, path: str | Path | None) -> bool:
        if not path:
            return False
        real = Path(os.path.realpath(path))
        return real.parent == Path(os.path.realpath(self.path))

    def usage_bytes(self) -> int:
        """Bytes of the files in the stage (staged copies and work in progress)."""
        total = 0
        for dirpath, _, names in os.walk(self.path):
            for n in names:
                try:
                    total += os.lstat(os.path.join(dirpath, n)).st_size
                except OSError:
                    pass
        return total

    def find(self, step: int, fingerprint: str) -> tuple[Path, Manifest] | None:
        """The staged full copy of the publication with this fingerprint, if one is here."""
        path = self._name_for(step, fingerprint)
        if not path.is_dir():
            return None
        try:
            manifest = Manifest.load(path, root=self.path)
        except CheckpointError:
            return None
        if manifest.source_fingerprint() != fingerprint or manifest.step != step:
            return None
        return path, manifest

    def _name_for(self, step: int, fingerprint: str) -> Path:
        return self.path / f"{step_dir_name(step)}-{fingerprint[:12]}"

    def _check_room(self, manifest_step: int, nbytes: int) -> None:
        """Room for ``nbytes`` more: a step larger than the whole stage is rejected
        (``too_large_for_stage``: its manifest lists more than this host can hold); one that
        only needs room freed is a ``StageError`` (the sync is tried again)."""
        need = nbytes + SPACE_MARGIN_BYTES
        usage = shutil.disk_usage(self.path)
        if need > usage.total:
            raise CheckpointError(
                "too_large_for_stage",
                f"step {manifest_step} needs {need >> 20} MiB in the stage, more than the"
                f" {usage.total >> 20} MiB its file system holds: its manifest lists files larger than"
                " the model (or give --stage-dir a file system with room for two copies of the model)",
            )
        free = usage.free
        if free < need:
            raise StageError(
                f"the stage directory {self.path} has {free >> 20} MiB free, step"
                f" {manifest_step} needs {need >> 20} MiB: give --stage-dir a folder with room"
                " for two copies of the model"
            )

    def build(
        self, root: Path, source_dir: Path, manifest: Manifest, deadline: Deadline, *, check_finite: bool = False
    ) -> StagedBuild:
        """A verified full copy of a published step here: copied (full) or rebuilt (delta).

        ``check_finite`` makes a rebuild refuse NaN/Inf in the tensors a delta changes (a full
        copy is checked by validating it afterwards)."""
        t0 = time.perf_counter()
        if manifest.kind != "delta":
            path = self.copy_in(root, source_dir, manifest, deadline)
            return StagedBuild(path, manifest.kind, manifest.total_bytes, time.perf_counter() - t0, 0)
        link = ChainLink(source_dir, manifest)
        chain = resolve_chain(root, link, self.find, deadline)
        try:
            return self._apply_chain(root, chain, deadline, t0, check_finite)
        except CheckpointError as exc:
            if exc.reason != "base_mismatch" or not chain.start_is_staged:
                raise
            log.warning(
                "the staged copy %s is damaged (%s); replaying the chain from its full step", chain.start.path.name, exc
            )
            _remove(chain.start.path)
            return self._apply_chain(root, resolve_chain(root, link, None, deadline), deadline, t0, check_finite)

    def _apply_chain(self, root: Path, chain: Chain, deadline: Deadline, t0: float, check_finite: bool) -> StagedBuild:
        bytes_read = 0
        made_here: set[Path] = set()
        if chain.start_is_staged:
            current = chain.start
        else:
            path = self.copy_in(root, chain.start.path, chain.start.manifest, deadline)
            bytes_read += chain.start.manifest.total_bytes
            current = ChainLink(path, Manifest.load(path, root=self.path))
            made_here.add(path)
        for link in chain.deltas:
            delta = link.manifest.delta
            assert delta is not None
            self._check_room(link.manifest.step, sum(e.size for e in delta.target_files.values()))
            final = self._name_for(link.manifest.step, link.manifest.fingerprint())
            if final.is_dir():
                _remove(final)  # a copy from an earlier try: rebuild it
            tmp = self.path / f"{TEMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            try:
                self._fill_from_spare(tmp, sorted(delta.target_files))
                rebuilt = reconstruct(root, link, current, self.path, tmp, deadline, check_finite=check_finite)
                os.rename(tmp, final)
            except BaseException:
                _remove(tmp)
                raise
            bytes_read += link.manifest.total_bytes
            if current.path in made_here:  # an intermediate version nobody serves
                self._retire(current.path)
            made_here.add(final)
            current = ChainLink(final, rebuilt)
        return StagedBuild(current.path, "delta", bytes_read, time.perf_counter() - t0, len(chain.deltas))

    def copy_in(self, root: Path, source_dir: Path, manifest: Manifest, deadline: Deadline) -> Path:
        """Copy the checkpoint's files here, verifying sizes and digests; return the copy."""
        self._check_room(manifest.step, manifest.total_bytes)
        final = self._name_for(manifest.step, manifest.fingerprint())
        if final.is_dir():
            _remove(final)  # a copy of the same bytes from an earlier try: redo it
        tmp = self.path / f"{TEMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
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
            os.rename(tmp, final)
        except BaseException:
            _remove(tmp)
            raise
        return final

    # --- the served model's reference ----------------------------------------------------
    def save_reference(self, specs: TensorSpecs, source: str) -> None:
        data = {"source": source, "tensors": {k: [dt, list(shape)] for k, (dt, shape) in specs.items()}}
        dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            atomic_replace(dir_fd, REFERENCE_NAME, json.dumps(data, sort_keys=True).encode())
        finally:
            os.close(dir_fd)

    def load_reference(self) -> tuple[TensorSpecs, str] | None:
        try:
            data = json.loads((self.path / REFERENCE_NAME).read_text())
            specs = {str(k): (str(v[0]), tuple(int(x) for x in v[1])) for k, v in data["tensors"].items()}
            return specs, str(data.get("source"))
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return None


def _remove(path: Path) -> None:
    """Remove a staged entry so that no half-deleted copy is ever seen under its own name: a
    directory is first renamed to a hidden ``.tmp-`` name (which the next start removes if this
    process dies mid-way), then deleted."""
    try:
        if path.is_dir() and not path.is_symlink():
            if not path.name.startswith(TEMP_PREFIX):
                hidden = path.with_name(f"{TEMP_PREFIX}deleting-{path.name}-{uuid.uuid4().hex[:8]}")
                os.rename(path, hidden)
                path = hidden
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass
