"""Node-local staging: SGLang loads only bytes the sidecar copied and verified itself.

Validating files on shared storage and then letting SGLang open them leaves a window in
which a writer can change them (time of check to time of use). The sidecar therefore
copies each published checkpoint into a directory only it writes (``--stage-dir``:
``/dev/shm`` when it has room, else a local folder), checks every byte of the copy against
the manifest's digests as it copies, validates the copy (headers, reference, finiteness),
and hands SGLang the copy. A copy becomes visible under its final name only by an atomic
rename, so a sidecar killed mid-copy leaves a hidden ``.tmp-*`` folder that the next start
removes. The stage holds the served copy and at most one being prepared.

The stage also keeps ``reference.json``: the tensor names, shapes and dtypes of the model
SGLang serves, learnt at the first load, so a restarted sidecar checks against the same
reference.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

from ..checkpoint_format import MANIFEST_NAME, TEMP_PREFIX, CheckpointError, Manifest, step_dir_name
from ..checkpoint_reader import TensorSpecs
from ..protocol import atomic_replace
from ..untrusted_files import Deadline, copy_verified

log = logging.getLogger(__name__)

REFERENCE_NAME = "reference.json"
LOCK_NAME = ".lock"
SPACE_MARGIN_BYTES = 64 << 20


class StageError(RuntimeError):
    """The stage itself failed (no room, not writable): not the checkpoint's fault."""


SHM_MIN_FREE_BYTES = 8 << 30
"""/dev/shm is chosen by default only when this much is free (a container's default /dev/shm
is 64 MiB; two copies of a 7B bf16 model need ~30 GB)."""


def default_stage_dir(replica_id: str, needed_bytes: int = SHM_MIN_FREE_BYTES // 2) -> Path:
    """``/dev/shm/rollout-stage-<replica>`` when /dev/shm has room for two copies of
    ``needed_bytes``, else a folder under ``~/.cache/rollout-service/stage``."""
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
            raise StageError(f"cannot create the stage directory {self.path}: {exc.strerror};"
                             " pass a writable node-local --stage-dir") from None
        self._lock = open(self.path / LOCK_NAME, "a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise StageError(f"another sidecar uses the stage directory {self.path}: give each"
                             " replica its own --stage-dir (or --replica-id)") from None
        for entry in self.path.iterdir():
            if entry.name.startswith(TEMP_PREFIX):
                _remove(entry)

    def close(self) -> None:
        self._lock.close()

    def prune(self, keep: set[Path]) -> None:
        """Remove staged copies other than ``keep`` (the one SGLang serves)."""
        keep_real = {Path(os.path.realpath(p)) for p in keep}
        for entry in self.path.iterdir():
            if entry.name in (REFERENCE_NAME, LOCK_NAME):
                continue
            if Path(os.path.realpath(entry)) not in keep_real:
                _remove(entry)

    def owns(self, path: str | Path | None) -> bool:
        if not path:
            return False
        real = Path(os.path.realpath(path))
        return real.parent == Path(os.path.realpath(self.path))

    def copy_in(self, root: Path, source_dir: Path, manifest: Manifest, deadline: Deadline) -> Path:
        """Copy the checkpoint's files here, verifying sizes and digests; return the copy."""
        need = manifest.total_bytes + SPACE_MARGIN_BYTES
        free = shutil.disk_usage(self.path).free
        if free < need:
            raise StageError(
                f"the stage directory {self.path} has {free >> 20} MiB free, step"
                f" {manifest.step} needs {need >> 20} MiB: give --stage-dir a folder with room"
                " for two copies of the model")
        fingerprint = manifest.fingerprint()[:12]
        final = self.path / f"{step_dir_name(manifest.step)}-{fingerprint}"
        if final.is_dir():
            shutil.rmtree(final)  # a copy of the same bytes from an earlier try: redo it
        tmp = self.path / f"{TEMP_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            for fname, entry in sorted(manifest.files.items()):
                where = f"{source_dir.name}/{fname}"
                copy_verified(root, source_dir / fname, tmp / fname, where=where, size=entry.size,
                              digest=entry.digest, deadline=deadline)
            (tmp / MANIFEST_NAME).write_text(manifest.to_json())
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
            specs = {str(k): (str(v[0]), tuple(int(x) for x in v[1]))
                     for k, v in data["tensors"].items()}
            return specs, str(data.get("source"))
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return None


def _remove(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass
