"""Atomic, streaming publication of checkpoints (the writer side of the format).

``publish_checkpoint`` takes an iterable of ``(name, tensor)`` pairs and writes
them as safetensors shards into a hidden temporary directory beside the final
one, digesting bytes as they are written. Only one shard's tensors are held at a
time (plus dtype-converted copies of that shard), never a second copy of the
whole model. The manifest is written last, every file and directory is fsynced,
and the directory is renamed into place (the one completion signal readers watch for).
A writer killed at any moment leaves at most a hidden ``.tmp-*`` directory,
which :func:`cleanup_stale_temp_dirs` removes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import stat
import struct
import time
import uuid
from collections.abc import Collection, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint_format import (
    CONFIG_NAME,
    DTYPE_SIZES,
    FLOAT_DTYPES,
    INDEX_NAME,
    MANIFEST_NAME,
    MAX_SHARD_HEADER_BYTES,
    RUN_ID_RE,
    TEMP_PREFIX,
    CheckpointError,
    FileEntry,
    Manifest,
    new_run_id,
    normalize_dtype,
    step_dir_name,
)
from .digest import format_digest, new_hasher
from .finite import count_non_finite
from .full_writes import write_all
from .protocol import version_for_step
from .tree_removal import remove_tree
from .untrusted_files import MAX_SMALL_FILE_BYTES
from .work_folders import left_by_dead_writer, new_file, open_work_folder, owner_tag, release_work_folder

log = logging.getLogger(__name__)

_TORCH_TO_TAG = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _tag in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _TORCH_TO_TAG[getattr(torch, _name)] = _tag
_TAG_TO_TORCH = {v: k for k, v in _TORCH_TO_TAG.items()}

DEFAULT_MAX_SHARD_BYTES = 2 << 30
FINITE_CHUNK_BYTES = 1 << 20
"""The NaN/Inf count runs over a tensor in parts of this size, each right after it is hashed
(still in cache): 0.03-0.05 s per GB of bf16 on the digest thread, beside the write."""


class PublishRefused(ValueError):
    """Weights that every reader would reject: nothing of the step is published.

    Raised before the step's folder appears in the root (a work folder already made is removed),
    so the newest published checkpoint stays the last good one. ``tensor`` is the tensor at
    fault, ``rule`` what it breaks (``tensor_name``, ``duplicate``, ``dtype``, ``header_too_large``,
    ``non_finite``; for a model folder, the rules of
    :func:`~rollout_service.model_dir_source.check_model_dir`), ``count`` its NaN/Inf values
    (``non_finite`` only).
    """

    def __init__(self, message: str, *, tensor: str, rule: str, count: int = 0):
        super().__init__(message)
        self.tensor = tensor
        self.rule = rule
        self.count = count


def check_tensor_name(name: object) -> str:
    """``name`` if a reader accepts it as a tensor name, else :class:`PublishRefused` naming the rule.

    Readers parse a shard's header with safetensors, a UTF-8 JSON object of tensor name ->
    entry in which ``__metadata__`` is the metadata entry; the manifest and the index are JSON
    too. So a name must be a non-empty string, valid Unicode (no lone surrogate: ``json.dumps``
    would write an escape that no JSON reader decodes), not ``__metadata__``, and short enough
    for its shard's header to stay within ``MAX_SHARD_HEADER_BYTES``.
    """
    if not isinstance(name, str) or not name:
        raise PublishRefused(
            f"tensor names must be non-empty strings, got {name!r}", tensor=repr(name), rule="tensor_name"
        )
    shown = _shown(name)
    if name == "__metadata__":
        raise PublishRefused(
            "tensor '__metadata__': the name is reserved for the safetensors metadata entry, which a tensor"
            " of that name would replace (every reader rejects the shard as header_invalid); rename the tensor."
            " Nothing was published",
            tensor=name,
            rule="tensor_name",
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PublishRefused(
            f"tensor {shown}: the name is not valid Unicode (lone surrogate {name[exc.start]!r} at"
            f" position {exc.start}), and safetensors headers are UTF-8 JSON (every reader rejects the shard"
            " as header_invalid); rename the tensor (a name decoded from bytes with errors='surrogateescape'"
            " carries such characters). Nothing was published",
            tensor=name,
            rule="tensor_name",
        ) from None
    if len(name) > MAX_SHARD_HEADER_BYTES // 16 and len(json.dumps(name)) + 64 > MAX_SHARD_HEADER_BYTES:
        raise PublishRefused(
            f"tensor {shown}: the name is {len(name)} characters, more than fits in the largest shard header"
            f" readers accept ({MAX_SHARD_HEADER_BYTES} bytes); rename the tensor. Nothing was published",
            tensor=name,
            rule="tensor_name",
        )
    return name


def _shown(name: str) -> str:
    text = repr(name)
    return text if len(text) <= 120 else f"{text[:100]}... ({len(name)} characters)"


def check_tensor_names(names: Iterable[object]) -> None:
    """Every name as :func:`check_tensor_name` wants it, and none twice."""
    seen: set[str] = set()
    for name in names:
        if check_tensor_name(name) in seen:
            raise duplicate_refusal(str(name))
        seen.add(str(name))


def check_tensor_dtype(name: str, tensor: torch.Tensor) -> None:
    """:class:`PublishRefused` (rule ``dtype``) naming ``name`` when ``tensor``'s dtype is none a
    checkpoint holds (complex, unsigned beyond 8 bits, ...), before anything is written."""
    if tensor.dtype not in _TORCH_TO_TAG:
        kinds = ", ".join(str(d).removeprefix("torch.") for d in _TORCH_TO_TAG)
        raise PublishRefused(
            f"tensor {_shown(name)} is {tensor.dtype}, which a checkpoint cannot hold (it holds {kinds}); keep"
            " such a tensor out of the published state or convert it. Nothing was published",
            tensor=name,
            rule="dtype",
        )


def duplicate_refusal(name: str) -> PublishRefused:
    return PublishRefused(f"tensor {_shown(name)} appears twice in the published state", tensor=name, rule="duplicate")


def non_finite_refusal(name: str, tag: str, numel: int, count: int) -> PublishRefused:
    """The error for a floating tensor that holds NaN/Inf values (as written, in ``tag``)."""
    return PublishRefused(
        f"tensor {_shown(name)} holds {count} NaN/Inf value(s) among its {numel} ({tag}): the step is not"
        " published (every replica would reject it as non_finite; the last good checkpoint stays the"
        " newest). The training diverged: the loss or the learning rate blew up, or the weights"
        f" overflow {tag}; lower the learning rate, clip gradients, or resume from the last good checkpoint",
        tensor=name,
        rule="non_finite",
        count=count,
    )


def count_non_finite_bytes(view: memoryview | np.ndarray, tag: str, scratch: np.ndarray) -> int:
    """NaN/Inf values in a tensor's bytes (0 for non-floating ``tag``), ``FINITE_CHUNK_BYTES`` at a
    time through ``scratch`` (``uint8``, at least that long)."""
    if tag not in FLOAT_DTYPES:
        return 0
    return sum(
        count_non_finite(view[i : i + FINITE_CHUNK_BYTES], tag, scratch)
        for i in range(0, len(view), FINITE_CHUNK_BYTES)
    )


@dataclass
class PublishResult:
    """What a publication produced, with its timings in seconds."""

    path: Path
    step: int
    weight_version: str
    total_bytes: int
    tensor_count: int
    files: int
    write_seconds: float
    total_seconds: float
    kind: str = "full"
    fingerprint: str = ""
    """The published manifest's fingerprint (a delta names its base by it)."""
    full_bytes: int = 0
    """What a full publish of the same weights writes (== total_bytes for a full one)."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prepare(tensor: torch.Tensor, target: str | None) -> torch.Tensor:
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if target is not None and _TORCH_TO_TAG.get(t.dtype) in FLOAT_DTYPES:
        want = _TAG_TO_TORCH[target]
        if t.dtype != want:
            t = t.to(want)
    if t.dtype not in _TORCH_TO_TAG:
        raise TypeError(f"tensor dtype {t.dtype} cannot be stored in safetensors")
    return t.contiguous()


def _byte_view(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def shard_prefix(specs: Iterable[tuple[str, str, tuple[int, ...] | list[int]]]) -> tuple[bytes, int]:
    """The bytes a shard starts with (length + JSON header, padded to 8) and its data length.

    ``specs`` are ``(name, dtype tag, shape)`` in file order. One definition for the full
    writer and the delta writer/applier: a reconstruction must match a full publish bit for bit.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tag, shape in specs:
        n = DTYPE_SIZES[tag]
        for dim in shape:
            n *= dim
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, offset


def shard_file_names(count: int) -> list[str]:
    """The names of ``count`` shards: ``model.safetensors`` alone, else ``model-0000i-of-0000N``."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def index_json(weight_map: dict[str, str], data_bytes: int) -> str:
    """``model.safetensors.index.json`` of a sharded checkpoint."""
    index = {"metadata": {"total_size": data_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(index, indent=2) + "\n"


def config_json(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def _write_shard(path: Path, tensors: list[tuple[str, torch.Tensor]], *, check_finite: bool = False) -> FileEntry:
    """Write one safetensors file (header, then raw data), digesting as it goes, and fsync it.

    With ``check_finite`` the digest thread also counts each floating tensor's NaN/Inf values,
    part by part right after hashing the part (still in cache: no second pass over memory), and
    :class:`PublishRefused` names the first tensor that holds any (the caller's work folder is
    then removed: nothing is published)."""
    prefix, offset = shard_prefix((name, _TORCH_TO_TAG[t.dtype], tuple(t.shape)) for name, t in tensors)
    if len(prefix) - 8 > MAX_SHARD_HEADER_BYTES:
        raise PublishRefused(
            f"the header of {path.name[:80]} ({len(tensors)} tensors, first {_shown(tensors[0][0])}) would be"
            f" {len(prefix) - 8} bytes, more than the {MAX_SHARD_HEADER_BYTES} readers accept: use shorter"
            " tensor names or a smaller max_shard_bytes. Nothing was published",
            tensor=tensors[0][0],
            rule="header_too_large",
        )
    hasher = new_hasher()
    hasher.update(prefix)
    scratch = np.empty(FINITE_CHUNK_BYTES, dtype=np.uint8) if check_finite else None

    def digest(view: memoryview, tag: str) -> int:
        """(On the digest thread.) Hash ``view``; return its NaN/Inf count (0 unchecked)."""
        if scratch is None or tag not in FLOAT_DTYPES:
            hasher.update(view)
            return 0
        bad = 0
        for i in range(0, len(view), FINITE_CHUNK_BYTES):
            part = view[i : i + FINITE_CHUNK_BYTES]
            hasher.update(part)
            bad += count_non_finite(part, tag, scratch)
        return bad

    # Digest on a second thread while this one sits in write() with the GIL released: the
    # digest (and the NaN/Inf count) then cost (almost) no wall time on top of the write.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="digest") as pool, new_file(path) as f:
        write_all(f.fileno(), prefix)
        pending: list[tuple[str, torch.Tensor, Future[int]]] = []
        checked = 0
        try:
            for name, t in tensors:
                view = _byte_view(t)
                pending.append((name, t, pool.submit(digest, view, _TORCH_TO_TAG[t.dtype])))
                write_all(f.fileno(), view)
                checked = _raise_if_non_finite(pending, checked, wait=False)
            _raise_if_non_finite(pending, checked, wait=True)
        except BaseException:
            for _, _, job in pending:
                job.cancel()
            raise
        os.fsync(f.fileno())
    return FileEntry(size=len(prefix) + offset, digest=format_digest(hasher), tensors=len(tensors))


def _raise_if_non_finite(pending: list[tuple[str, torch.Tensor, Future[int]]], checked: int, *, wait: bool) -> int:
    """Raise for the first tensor of ``pending[checked:]`` that holds NaN/Inf, in order, looking
    only at finished counts unless ``wait``; return how many are known to be clean."""
    for name, t, job in pending[checked:]:
        if not wait and not job.done():
            break
        count = job.result()
        if count:
            raise non_finite_refusal(name, _TORCH_TO_TAG[t.dtype], t.numel(), count)
        checked += 1
    return checked


class ShardPlanner:
    """Where shards break: a tensor starts a new shard when it would overflow the current one.

    The one rule for the full writer and the delta writer (whose reconstruction must have the
    same files as a full publish of the same weights).
    """

    def __init__(self, max_shard_bytes: int):
        self.max_shard_bytes = max_shard_bytes
        self.size = 0
        self.items = 0
        self.count = 0

    def starts_new_shard(self, nbytes: int) -> bool:
        """Account for the next tensor; True when it opens a new shard (also for the first)."""
        new = self.items == 0 or self.size + nbytes > self.max_shard_bytes
        if new:
            self.count += 1
            self.size = self.items = 0
        self.size += nbytes
        self.items += 1
        return new


def _shards(
    named: Iterable[tuple[str, torch.Tensor]], target: str | None, max_shard_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    batch: list[tuple[str, torch.Tensor]] = []
    planner = ShardPlanner(max_shard_bytes)
    seen: set[str] = set()
    for name, tensor in named:
        if check_tensor_name(name) in seen:
            raise duplicate_refusal(name)
        seen.add(name)
        check_tensor_dtype(name, tensor)
        t = _prepare(tensor, target)
        if planner.starts_new_shard(t.numel() * t.element_size()) and batch:
            yield batch
            batch = []
        batch.append((name, t))
    if batch:
        yield batch


def publish_checkpoint(
    root: Path | str,
    step: int,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    config: dict[str, Any] | Path | str | bytes | None,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    base_model: str | None = None,
    run_id: str | None = None,
    check_finite: bool = True,
) -> PublishResult:
    """Publish ``tensors`` as ``<root>/step-<step>`` atomically and return what was written.

    Tensors are kept until the shard they fall in is written (at most ``max_shard_bytes``),
    so the iterable must not reuse or modify a yielded tensor's storage before it is
    exhausted: yield copies of transient buffers (gathered ZeRO-3 parameters, merged PEFT
    weights). ``config`` is the model's ``config.json`` (a dict, a path to the file, or its bytes);
    ``dtype`` converts floating tensors (``"bfloat16"``...). ``run_id`` names the
    publishing run (its lineage; default: a fresh id per call), so that readers can tell
    this run's step N from another run's step N in a reused root. Raises
    ``FileExistsError`` if that step is already published.

    Weights every reader would reject are refused with :class:`PublishRefused` (a
    ``ValueError``) and nothing of the step becomes visible: a tensor name readers cannot
    parse (see :func:`check_tensor_name`: checked before the work folder is made when
    ``tensors`` is a collection such as a list, else as the names stream in) and, with
    ``check_finite`` (the default; False only to make checkpoints that readers must reject, in
    tests), a floating tensor holding NaN/Inf as written (counted while the bytes are hashed).
    """
    t0 = time.perf_counter()
    target = normalize_dtype(dtype)
    run_id = check_run_id(run_id)
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if isinstance(tensors, Collection) and not isinstance(tensors, (str, bytes, dict)):
        check_tensor_names(name for name, _ in tensors)  # before the work folder: nothing to undo
    with atomic_step_dir(root, step) as tmp:
        files: dict[str, FileEntry] = {}
        weight_map: dict[str, str] = {}
        dtypes: set[str] = set()
        data_bytes = 0
        for i, shard in enumerate(_shards(tensors, target, max_shard_bytes), start=1):
            part = f"shard-{i:05d}.part"
            files[part] = _write_shard(tmp / part, shard, check_finite=check_finite)
            for tname, t in shard:
                weight_map[tname] = part
                data_bytes += t.numel() * t.element_size()
                tag = _TORCH_TO_TAG[t.dtype]
                if tag in FLOAT_DTYPES:
                    dtypes.add(tag)
            del shard
        if not files:
            raise ValueError("no tensors to publish: the iterable was empty")
        write_seconds = time.perf_counter() - t0
        # Give shards their final names now that their count is known.
        parts = sorted(files)
        names = dict(zip(parts, shard_file_names(len(parts))))
        files = {names[p]: files[p] for p in parts}
        for p, final_name in names.items():
            os.rename(tmp / p, tmp / final_name)
        if len(parts) > 1:
            files[INDEX_NAME] = write_small(
                tmp / INDEX_NAME, index_json({k: names[v] for k, v in weight_map.items()}, data_bytes)
            )
        if config is not None:
            files[CONFIG_NAME] = write_small(tmp / CONFIG_NAME, config_text(config))
        manifest = write_manifest(
            tmp,
            step,
            files,
            base_model=base_model,
            dtype=target or (dtypes.pop() if len(dtypes) == 1 else None),
            tensor_count=len(weight_map),
            run_id=run_id,
        )
    final = Path(root) / step_dir_name(step)
    total = time.perf_counter() - t0
    log.info(
        "published %s: %d tensors, %.1f MB in %.2f s", final, manifest.tensor_count, manifest.total_bytes / 1e6, total
    )
    return PublishResult(
        path=final,
        step=step,
        weight_version=manifest.weight_version,
        total_bytes=manifest.total_bytes,
        tensor_count=manifest.tensor_count,
        files=len(files),
        write_seconds=write_seconds,
        total_seconds=total,
        fingerprint=manifest.fingerprint(),
        full_bytes=manifest.total_bytes,
    )


def check_run_id(run_id: str | None) -> str:
    """``run_id``, or a fresh one when None; raises ValueError for an id readers would refuse."""
    run_id = new_run_id() if run_id is None else run_id
    if not RUN_ID_RE.fullmatch(run_id):
        raise ValueError(f"run_id must be 1-64 letters, digits, '_' or '-', got {run_id!r}")
    return run_id


MAX_MANIFEST_BYTES = MAX_SMALL_FILE_BYTES
"""The largest ``manifest.json`` readers read (they refuse a larger one as ``too_large``): a
full or adapter step's lists its files only (kilobytes), a delta's every tensor of the model
(~300 bytes each: ~55,000 tensors fill it). The delta writer publishes in full a version whose
delta manifest would not fit; :func:`write_manifest` refuses any that does not."""
MANIFEST_TIME_SLACK = 32
"""Bytes a manifest measured before its files are written may grow by when it is written: its
``created_at`` is taken again then, and a float's text varies in length by a few characters."""


def new_manifest(step: int, files: dict[str, FileEntry], *, tensor_count: int, **fields: Any) -> Manifest:
    """The manifest of ``step`` describing ``files``: the one place that fills what every kind's
    manifest shares (step, weight version, time, writer and total size); ``fields`` are the rest
    (dtype, base_model, run_id, kind, ...)."""
    return Manifest(
        step=step,
        weight_version=version_for_step(step),
        created_at=time.time(),
        writer=writer_identity(),
        total_bytes=sum(e.size for e in files.values()),
        tensor_count=tensor_count,
        files=files,
        **fields,
    )


def manifest_bytes(manifest: Manifest) -> bytes:
    """``manifest`` as written, or :class:`PublishRefused` (``manifest_too_large``) when readers
    would refuse it (over :data:`MAX_MANIFEST_BYTES`)."""
    raw = manifest.to_json().encode()
    if len(raw) > MAX_MANIFEST_BYTES:
        raise PublishRefused(
            f"the manifest of step {manifest.step} ({manifest.kind}, {manifest.tensor_count} tensors) would be"
            f" {len(raw)} bytes, more than the {MAX_MANIFEST_BYTES} readers read: every reader would refuse it."
            " Nothing was published",
            tensor="",
            rule="manifest_too_large",
        )
    try:  # what readers would refuse is never published (a base_model too long, a writer field)
        Manifest.from_json(raw)
    except CheckpointError as exc:
        raise PublishRefused(
            f"the manifest of step {manifest.step} would be refused by every reader ({exc}). Nothing was published",
            tensor="",
            rule="bad_manifest",
        ) from None
    return raw


def write_manifest(tmp: Path, step: int, files: dict[str, FileEntry], *, tensor_count: int, **fields: Any) -> Manifest:
    """Write ``manifest.json`` (last, describing ``files``, see :func:`new_manifest`) into a step's
    work folder; return it. One readers would refuse as too large raises :class:`PublishRefused`
    (see :func:`manifest_bytes`): the step is not published."""
    manifest = new_manifest(step, files, tensor_count=tensor_count, **fields)
    write_small(tmp / MANIFEST_NAME, manifest_bytes(manifest))
    return manifest


def writer_identity() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "tool": "rollout-service"}


@contextlib.contextmanager
def atomic_step_dir(root: Path | str, step: int) -> Iterator[Path]:
    """A hidden work folder that becomes ``<root>/step-<step>`` by one rename when the block ends.

    The folder is this writer's alone while it is written (see
    :data:`~rollout_service.work_folders.WORK_FOLDER_MODE`; create files in it with
    :func:`~rollout_service.work_folders.new_file`) and gets the usual mode just before the rename.
    Everything written in it is fsynced first; on any error before the rename the folder is
    removed (nothing of the step is visible). Raises ``FileExistsError`` when the step is already
    published (steps are immutable), or when anything else holds its name (a stray file, a link, a
    folder without a manifest). Once renamed, the step is published: a failure to fsync the root
    then is logged, not raised (the step is visible and complete; only its durability across a
    power loss is in doubt).
    """
    root = Path(root)
    name = step_dir_name(step)
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    published = is_published_dir(final)
    if published is not None:
        what = (
            "already published"
            if published
            else "taken by something that is not a checkpoint (a file, a link, or a folder without"
            f" {MANIFEST_NAME}: remove it)"
        )
        raise FileExistsError(f"{final} is {what}; steps are immutable, publish a new step instead")
    tmp = root / f"{TEMP_PREFIX}{name}-{owner_tag()}-{uuid.uuid4().hex[:12]}"
    dir_fd, published_mode = open_work_folder(tmp)
    try:
        yield tmp
        release_work_folder(dir_fd, published_mode)
        fsync_dir(tmp)
        if os.path.lexists(final):
            raise FileExistsError(f"{final} was published by another writer meanwhile")
        try:
            os.rename(tmp, final)
        except OSError as exc:  # a folder there after all (a network file system's cached "absent")
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(f"{final} was published by another writer meanwhile") from None
            raise
    except BaseException:
        try:  # whatever was written into the hidden folder meanwhile, however deep
            remove_tree(tmp)
        except Exception as exc:
            log.warning("could not remove %s after a failed publish (%s): remove it by hand", tmp, exc)
        raise
    finally:
        os.close(dir_fd)
    try:
        fsync_dir(root)
    except OSError as exc:
        log.warning(
            "published %s, but syncing %s to disk failed (%s): it may not survive a power loss", final, root, exc
        )


def config_text(config: dict[str, Any] | Path | str | bytes) -> str | bytes:
    """The bytes of ``config.json``: a dict rendered canonically, bytes as they are (a file read and
    checked before, see :func:`~rollout_service.model_dir_source.publish_model_dir`), or a file's bytes as they are."""
    if isinstance(config, dict):
        return config_json(config)
    if isinstance(config, bytes):
        return config
    return Path(config).read_bytes()


def is_published_dir(path: Path) -> bool | None:
    """Whether ``path`` is a real folder holding a ``manifest.json`` file; None when it is gone.

    Publishing renames a complete folder, manifest written last, into place, so a folder without
    one was never published, nor was a file or a link (looked at with ``lstat`` only: never
    followed). Any other error (EIO, EACCES) counts as published: retention then meets a
    checkpoint it cannot read, and deletes nothing that checkpoint might need.
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError:
        return True
    if not stat.S_ISDIR(mode):
        return False
    try:
        return stat.S_ISREG(os.lstat(path / MANIFEST_NAME).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True


def file_entry(raw: bytes) -> FileEntry:
    """The manifest entry of a file holding ``raw``."""
    hasher = new_hasher()
    hasher.update(raw)
    return FileEntry(size=len(raw), digest=format_digest(hasher))


def write_small(path: Path, data: str | bytes) -> FileEntry:
    """Write a small file new in a work folder (:func:`~rollout_service.work_folders.new_file`),
    fsync it, and return its manifest entry."""
    raw = data.encode() if isinstance(data, str) else data
    with new_file(path) as f:
        write_all(f.fileno(), raw)
        os.fsync(f.fileno())
    return file_entry(raw)


MAX_STALE_PER_SWEEP = 1000
"""Stale temporary entries one sweep collects (the next sweep takes the rest): the removals
one sweep makes, and the list it keeps, stay bounded however many stale ``.tmp-*`` entries a
root holds. Fresh ones are still looked at (one ``lstat`` each, up to ``MAX_ROOT_ENTRIES``)."""


def stale_temp_entries(root: Path | str, older_than_s: float = 3600.0) -> list[Path]:
    """The hidden ``.tmp-*`` entries of ``root`` that :func:`cleanup_stale_temp_dirs` removes:
    older than ``older_than_s`` (by their own modification time: a writer at work adds files to
    its folder), or a work folder of a writer on this host whose process is gone. At most
    :data:`MAX_STALE_PER_SWEEP` of them, from the first ``MAX_ROOT_ENTRIES`` entries listed (as
    every reader of the root stops there)."""
    from .checkpoint_reader import MAX_ROOT_ENTRIES

    root = Path(root)
    stale: list[Path] = []
    now = time.time()
    if not root.is_dir():
        return stale
    with os.scandir(root) as listing:
        for i, found in enumerate(listing):
            if i >= MAX_ROOT_ENTRIES or len(stale) >= MAX_STALE_PER_SWEEP:
                log.warning(
                    "the checkpoint root %s holds more entries than one sweep of stale temporary entries"
                    " looks at (%d listed, %d stale found): the rest wait for the next sweep; remove what"
                    " is not a checkpoint from it",
                    root,
                    i,
                    len(stale),
                )
                break
            if not found.name.startswith(TEMP_PREFIX):
                continue
            entry = root / found.name
            try:
                if now - entry.lstat().st_mtime >= older_than_s or left_by_dead_writer(entry.name):
                    stale.append(entry)
            except FileNotFoundError:
                continue
    return stale


def cleanup_stale_temp_dirs(root: Path | str, older_than_s: float = 3600.0) -> list[Path]:
    """Remove hidden ``.tmp-*`` entries left by killed writers: older than ``older_than_s``, or
    a step work folder of a writer on this host whose process is gone (a trainer that crashed
    and restarted within the hour does not pile up model-sized folders).

    Returns what was removed. An entry that cannot be removed (a folder someone made read-only,
    a tree too deep for ``shutil.rmtree``) is logged with its path and what to do, and the others
    are still removed: a clean-up never stops the trainer that runs it.
    """
    removed: list[Path] = []
    for entry in stale_temp_entries(root, older_than_s):
        try:
            remove_tree(entry)
            removed.append(entry)
        except FileNotFoundError:
            continue
        except Exception as exc:  # whatever a stray tree makes removal raise, the others go on
            log.warning(
                "could not remove the stale temporary entry %s: %s: %s; it takes space until removed:"
                " remove it by hand (give yourself write permission inside it first if needed)",
                entry,
                type(exc).__name__,
                exc,
            )
    return removed


def iter_unique_tensors(state: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Drop tensors that share storage with an earlier one (tied ``lm_head`` and the like),
    as ``save_pretrained`` does, so a checkpoint of a tied model matches its base model."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, t in state:
        key = (
            (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if t.device.type != "meta"
            else (id(t), 0, ())
        )
        if t.numel() and key in seen:
            continue
        seen.add(key)
        yield name, t
