"""Listing and validating published checkpoints (the reader side of the format).

Everything under the root is untrusted input: files are opened through
:mod:`~rollout_service.untrusted_files` (inside the root, regular files only, never
blocking, sizes capped), JSON is parsed strictly, and a whole validation runs under a
deadline. By default validation reads headers only (safetensors' own parser, with numpy,
no torch), so the slim sidecar can run it; ``check_digests`` re-reads every byte and
``check_finite`` refuses NaN/Inf weights. Every failure, whatever raised it, comes out as
:class:`~rollout_service.checkpoint_format.CheckpointError` with a stable ``reason`` code
and a message that names the file and what was wrong.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import safe_open

from .checkpoint_format import (
    CONFIG_NAME,
    DTYPE_SIZES,
    FLOAT_DTYPES,
    INDEX_NAME,
    MAX_SHARD_HEADER_BYTES,
    CheckpointError,
    Manifest,
    parse_json_object,
    parse_step_dir_name,
    refuse_step_link,
)
from .checkpoint_paths import resolve_inside
from .digest import format_digest, new_hasher
from .finite import count_non_finite
from .full_writes import write_all
from .safetensors_header import count_entries, read_header
from .shown_values import shown
from .untrusted_files import (
    NO_DEADLINE,
    Deadline,
    any_failure_is_the_steps,
    fd_path,
    open_regular,
    read_small,
    unreadable,
)

TensorSpecs = dict[str, tuple[str, tuple[int, ...]]]
"""tensor name -> (safetensors dtype tag, shape)"""
HeaderCheck = Callable[[memoryview], None]
"""Looks at a safetensors header's JSON (the bytes after its length field) before safetensors
parses it, and raises ``CheckpointError`` to stop the parse (see :func:`_specs_of_fd`)."""


@dataclass(frozen=True)
class PublishedCheckpoint:
    """A ``step-*`` directory found under a checkpoint root (not yet validated)."""

    step: int
    path: Path
    is_dir: bool = field(default=True, compare=False)
    """Whether the listing saw a directory (not a link): a file named like a step is no publish."""


@dataclass
class ValidationReport:
    """A checkpoint that passed validation, with what was checked."""

    path: Path
    manifest: Manifest
    specs: TensorSpecs
    digests_checked: bool
    checks: list[str] = field(default_factory=list)
    finite_checked: bool = False


MAX_ROOT_ENTRIES = 1_000_000
"""A listing is read at most this far (a root flooded with entries cannot stall a reader);
past it, :func:`list_checkpoints` refuses (``too_many_entries``) rather than miss steps."""
MAX_CHECKPOINT_ENTRIES = 10_000


def list_checkpoints(root: Path | str) -> list[PublishedCheckpoint]:
    """Published checkpoints under ``root`` in step order. Hidden and other entries are ignored.

    Step directories are recognised by name only (``step-`` and 8 ASCII digits); whether one
    is a real directory inside the root is for validation to decide. A root holding more than
    :data:`MAX_ROOT_ENTRIES` entries raises ``CheckpointError('too_many_entries')``: a listing
    cut short could miss the newest step without a word.
    """
    root = Path(root)
    found = []
    try:
        with os.scandir(root) as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_ROOT_ENTRIES:
                    raise CheckpointError(
                        "too_many_entries",
                        f"the checkpoint root {root} holds more than {MAX_ROOT_ENTRIES} entries, past which"
                        " it is not read: remove what is not a checkpoint from it (no new step loads until then)",
                    )
                step = parse_step_dir_name(entry.name)
                if step is not None:
                    is_dir = _is_dir_entry(entry)
                    found.append(PublishedCheckpoint(step=step, path=root / entry.name, is_dir=is_dir))
    except FileNotFoundError:
        return []
    return sorted(found, key=lambda c: c.step)


def _is_dir_entry(entry: os.DirEntry[str]) -> bool:
    """The listing's own word (no extra look where the file system names the type); an entry
    gone meanwhile, or whose type cannot be read, counts as a directory (validation decides)."""
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return True


def latest_checkpoint(root: Path | str) -> PublishedCheckpoint | None:
    """The highest-step published checkpoint (the directory listing is the truth)."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def _some(names: list[str]) -> str:
    """The first three of ``names`` for a message, each quoted and cut (untrusted names)."""
    return ", ".join(shown(n) for n in names[:3])


CASTABLE_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
"""Floating dtypes SGLang casts into any floating parameter on load (not the FP8 formats,
whose loading needs scales)."""


def read_safetensors_specs(
    path: Path,
    *,
    root: Path | None = None,
    max_header_bytes: int = MAX_SHARD_HEADER_BYTES,
    check: HeaderCheck | None = None,
) -> TensorSpecs:
    """Tensor names, dtypes and shapes of one safetensors file, from its header only.

    safetensors rejects a header that does not cover the file exactly, which is the
    same check that makes SGLang crash on a truncated file. The file is opened through
    :func:`~rollout_service.untrusted_files.open_regular` (inside ``root``: default its folder).
    A header longer than ``max_header_bytes`` is refused (``header_too_large``) from its length
    field, before any of it is read: a kind of file with smaller headers (an adapter's) gives
    its own cap, so a crafted one cannot make the parse take seconds and hundreds of MB.
    ``check`` sees the header's JSON before safetensors parses it (as :func:`_specs_of_fd`).
    """
    path = Path(path)
    with open_regular(root if root is not None else path.parent, path, where=path.name) as (fd, _):
        return _specs_of_fd(fd, path.name, max_header_bytes, check)


def _specs_of_fd(
    fd: int, where: str, max_header_bytes: int = MAX_SHARD_HEADER_BYTES, check: HeaderCheck | None = None
) -> TensorSpecs:
    """The specs of the safetensors file behind ``fd``, from safetensors' parse of its header.
    ``check`` sees the header's JSON first (a header whose length field is refused, or runs past
    the file, is not shown to it: safetensors refuses it): the way to refuse a header that
    declares more, or other, tensors than it may before safetensors and this function make
    objects of all of them (see :func:`_full_specs`)."""
    try:
        with _header_copy(fd, where, max_header_bytes, check) as path, safe_open(path, framework="numpy") as f:
            return {k: (str(f.get_slice(k).get_dtype()), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises its own error types from Rust
        raise CheckpointError(
            "header_invalid",
            f"{where}: the safetensors header does not describe the file ({str(exc)[:200]});"
            " the file is corrupt or was modified after publishing",
        ) from None


@contextlib.contextmanager
def _header_copy(fd: int, where: str, max_header_bytes: int, check: HeaderCheck | None = None) -> Iterator[str]:
    """A path to a private copy of the safetensors file behind ``fd``: its first 8 bytes and
    header, then a hole up to the file's size (no memory, no disk). ``check``, when given, sees
    the header's JSON first (read from the copy), unless the length field leaves none to see.

    safetensors maps the file it opens and parses the header from the map: a root file
    truncated by someone else meanwhile (a large header takes a while) would kill this
    process with SIGBUS. Nobody else can truncate the copy, and safetensors still checks the
    header against the file's size. Without ``memfd_create`` the file itself is opened (and
    ``check`` sees a copy of its header read with ``pread``).
    """
    size = os.fstat(fd).st_size
    keep = _header_end(fd, where, size, max_header_bytes)
    if not hasattr(os, "memfd_create"):
        if check is not None and keep > 8:
            header = memoryview(bytearray(keep - 8))
            _pread_exactly(fd, header, 8, where, size)
            check(header)
            del header
        yield fd_path(fd)
        return
    copy = os.memfd_create("safetensors-header", getattr(os, "MFD_CLOEXEC", 0))
    try:
        with open(copy, "wb", buffering=0, closefd=False) as out:
            buf = memoryview(bytearray(min(_READ_CHUNK, keep)))
            for offset in range(0, keep, len(buf) or 1):
                piece = buf[: min(len(buf), keep - offset)]
                _pread_exactly(fd, piece, offset, where, size)
                write_all(out.fileno(), piece)
        os.ftruncate(copy, size)
        if check is not None and keep > 8:
            # The copy's pages, mapped: the header is not held a second time to be looked at.
            with mmap.mmap(copy, keep, prot=mmap.PROT_READ) as mapped, memoryview(mapped) as view:
                with view[8:keep] as header:
                    check(header)
        yield fd_path(copy)
    finally:
        os.close(copy)


def _header_end(fd: int, where: str, size: int, max_header_bytes: int) -> int:
    """Where the header of the safetensors file behind ``fd`` (``size`` bytes) ends, from its
    8-byte length field: what a private copy needs. A header longer than ``max_header_bytes``
    is refused here (``header_too_large``), before any of it is copied or parsed; one said to
    run past the file keeps only the length field (safetensors refuses it from that alone)."""
    if size < 8:
        return size
    head = memoryview(bytearray(8))
    _pread_exactly(fd, head, 0, where, size)
    (header_len,) = struct.unpack("<Q", head)
    if header_len > size - 8:
        return 8
    if header_len > max_header_bytes:
        raise CheckpointError(
            "header_too_large",
            f"{where}: its safetensors header has {header_len} bytes, more than the {max_header_bytes}"
            " such a file may have (no writer of this project makes one): republish it",
        )
    return 8 + header_len


def read_model_specs(model_dir: Path | str) -> TensorSpecs:
    """Tensor specs of every ``*.safetensors`` file in a model or checkpoint directory."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors files to compare against")
    specs: TensorSpecs = {}
    for path in files:
        # A model directory the operator names is trusted to link where it likes (the HF
        # cache links snapshots to blobs); only the file behind the link must be regular.
        real = Path(os.path.realpath(path))
        specs.update(read_safetensors_specs(real, root=real.parent))
    return specs


def compare_specs(found: TensorSpecs, expected: TensorSpecs, *, where: str, allow_float_cast: bool = False) -> None:
    """Raise on the first difference in tensor names, shapes or dtypes.

    ``allow_float_cast`` accepts any of :data:`CASTABLE_FLOAT_DTYPES` where the reference has
    one of them (SGLang casts on load); integer, boolean and FP8 tensors must match exactly.
    """
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(
            "missing_tensor",
            f"{where} lacks {len(missing)} tensor(s) the reference has, e.g. {_some(missing)}",
        )
    extra = sorted(set(found) - set(expected))
    if extra:
        raise CheckpointError(
            "extra_tensor",
            f"{where} has {len(extra)} tensor(s) the reference lacks, e.g. {_some(extra)}",
        )
    for name in sorted(expected):
        dtype, shape = found[name]
        want_dtype, want_shape = expected[name]
        if shape != want_shape:
            raise CheckpointError(
                "shape_mismatch",
                f"{where}: tensor {shown(name)} has shape {list(shape)}, the reference has {list(want_shape)}"
                " (resized embeddings or another architecture: SGLang cannot load it into the"
                " served model; start the server from a matching model)",
            )
        if dtype != want_dtype and not (
            allow_float_cast and dtype in CASTABLE_FLOAT_DTYPES and want_dtype in CASTABLE_FLOAT_DTYPES
        ):
            raise CheckpointError(
                "dtype_mismatch",
                f"{where}: tensor {shown(name)} has dtype {dtype}, the reference has {want_dtype}",
            )


def check_loadable_dtypes(specs: TensorSpecs, *, where: str) -> None:
    """Without a reference, only floating tensors SGLang can cast are accepted."""
    odd = sorted(k for k, (dt, _) in specs.items() if dt not in CASTABLE_FLOAT_DTYPES)
    if odd:
        raise CheckpointError(
            "dtype_unloadable",
            f"{where}: tensor {odd[0]} has dtype {specs[odd[0]][0]}, which cannot be loaded into"
            f" a model's floating parameters (allowed: {sorted(CASTABLE_FLOAT_DTYPES)})",
        )


def validate_checkpoint(
    checkpoint_dir: Path | str,
    *,
    root: Path | str | None = None,
    reference: TensorSpecs | None = None,
    allow_float_cast: bool = False,
    check_digests: bool = False,
    check_finite: bool = False,
    timeout_s: float | None = None,
    timeout_flag: str | None = None,
) -> ValidationReport:
    """Check that ``checkpoint_dir`` is a complete, self-consistent published checkpoint.

    ``root`` confines every path (default: the checkpoint's parent directory).
    ``reference`` (see :func:`read_model_specs`) must match tensor names, shapes
    and dtypes; ``allow_float_cast`` accepts a different floating dtype (SGLang
    casts on load). ``check_digests`` re-reads every byte and compares digests;
    ``check_finite`` refuses NaN/Inf in floating tensors (it reads every byte too).
    ``timeout_s`` bounds the whole validation (``validation_timeout``, naming ``timeout_flag``,
    the setting that gives it). Any failure, of whatever kind, raises ``CheckpointError``.
    """
    checkpoint_dir = Path(checkpoint_dir).absolute()  # a relative root would double (resolve_inside)
    deadline = NO_DEADLINE
    if timeout_s is not None:
        deadline = Deadline(timeout_s) if timeout_flag is None else Deadline(timeout_s, flag=timeout_flag)
    with any_failure_is_the_steps(checkpoint_dir.name):
        return _validate(
            checkpoint_dir,
            Path(root).absolute() if root is not None else checkpoint_dir.parent,
            reference,
            allow_float_cast,
            check_digests,
            check_finite,
            deadline,
        )


def _validate(
    checkpoint_dir: Path,
    root: Path,
    reference: TensorSpecs | None,
    allow_float_cast: bool,
    check_digests: bool,
    check_finite: bool,
    deadline: Deadline,
) -> ValidationReport:
    refuse_step_link(checkpoint_dir)
    real_dir = resolve_inside(root, checkpoint_dir)
    if not real_dir.is_dir():
        raise CheckpointError("missing_checkpoint", f"{checkpoint_dir.name} is not a directory")
    name = checkpoint_dir.name
    checks = ["inside root"]
    manifest = Manifest.load(real_dir, root=root)
    checks.append("manifest parses")
    step = parse_step_dir_name(name)
    if step is not None and manifest.step != step:
        raise CheckpointError(
            "bad_manifest", f"{name}/manifest.json says step {manifest.step}, the directory says {step}"
        )
    # Files SGLang would load but the manifest does not vouch for.
    with os.scandir(real_dir) as listing:
        for i, found in enumerate(listing):
            if i >= MAX_CHECKPOINT_ENTRIES:
                raise CheckpointError("too_many_entries", f"{name} holds more than {MAX_CHECKPOINT_ENTRIES} entries")
            # An index picks which shards SGLang loads: one the manifest does not list can make it
            # load none of the listed ones ("Cannot find any model weights").
            sglang_reads = found.name.endswith(".safetensors") or found.name.endswith(".safetensors.index.json")
            if sglang_reads and found.name not in manifest.files:
                raise CheckpointError(
                    "unlisted_file",
                    f"{name}/{found.name} is not in the manifest; SGLang would read it."
                    " Remove it or republish the checkpoint",
                )
    deadline.check(name)
    total = 0
    for fname, entry in sorted(manifest.files.items()):
        where = f"{name}/{fname}"
        try:
            with open_regular(root, real_dir / fname, where=where) as (_, st):
                size = st.st_size
        except CheckpointError as exc:
            if exc.reason == "missing_file":
                raise CheckpointError("missing_file", f"{where} is listed in the manifest but does not exist") from None
            raise
        if size < entry.size:
            raise CheckpointError(
                "truncated",
                f"{where} is truncated: {size} bytes on disk, the manifest says {entry.size}",
            )
        if size != entry.size:
            raise CheckpointError("size_mismatch", f"{where} has {size} bytes on disk, the manifest says {entry.size}")
        total += size
    if total != manifest.total_bytes:
        raise CheckpointError(
            "size_mismatch",
            f"{name}: files add up to {total} bytes, manifest total_bytes says {manifest.total_bytes}",
        )
    checks.append("every file present with its manifest size")
    if CONFIG_NAME not in manifest.files:
        raise CheckpointError("missing_file", f"{name}: the manifest lists no {CONFIG_NAME}")
    parse_json_object(
        read_small(root, real_dir / CONFIG_NAME, where=f"{name}/{CONFIG_NAME}"),
        where=f"{name}/{CONFIG_NAME}",
        reason="bad_config",
        unique_keys=False,
    )
    if manifest.kind == "delta":
        specs = _delta_specs(root, real_dir, name, manifest, deadline)
        shards: list[str] = []  # nothing loadable: the files are compressed XORs
        checks.append("delta files hold the blobs the manifest names")
    else:
        shards, specs = _full_specs(root, real_dir, name, manifest, deadline, reference)
        checks.append("safetensors headers cover their files")
        if len(shards) > 1 or INDEX_NAME in manifest.files:
            checks.append("index matches shards")
    if manifest.dtype is not None:
        odd = sorted(k for k, (dt, _) in specs.items() if dt in FLOAT_DTYPES and dt != manifest.dtype)
        if odd:
            raise CheckpointError(
                "dtype_mismatch",
                f"{name}: tensor {odd[0]} has dtype {specs[odd[0]][0]}, the manifest says every"
                f" floating tensor is {manifest.dtype}",
            )
    if reference is not None:
        compare_specs(specs, reference, where=name, allow_float_cast=allow_float_cast)
        checks.append("tensor names, shapes and dtypes match the reference")
    else:
        check_loadable_dtypes(specs, where=name)
        checks.append("every tensor has a loadable floating dtype")
    if check_digests or check_finite:
        for fname, entry in sorted(manifest.files.items()):
            read_every_byte(
                root,
                real_dir / fname,
                f"{name}/{fname}",
                entry.digest,
                check_digests,
                check_finite and fname in shards,
                deadline,
            )
        if check_digests:
            checks.append("digests match")
        if check_finite and shards:
            checks.append("every floating weight is finite")
    return ValidationReport(
        path=real_dir,
        manifest=manifest,
        specs=specs,
        digests_checked=check_digests,
        checks=checks,
        finite_checked=check_finite and bool(shards),
    )


def published_step_specs(
    checkpoint_dir: Path | str, *, root: Path | str, timeout_s: float | None = None
) -> TensorSpecs:
    """The tensor specs a published full step's shards declare, read from the shards its manifest
    lists (their headers only): what SGLang holds once it loaded that step. Anything else in the
    (untrusted) folder is never read. Raises ``CheckpointError``."""
    checkpoint_dir, root = Path(checkpoint_dir).absolute(), Path(root).absolute()
    real_dir = resolve_inside(root, checkpoint_dir)
    manifest = Manifest.load(real_dir, root=root)
    if manifest.kind != "full":
        raise CheckpointError("bad_manifest", f"{checkpoint_dir.name} is a {manifest.kind} step, not a full one")
    return _full_specs(root, real_dir, checkpoint_dir.name, manifest, Deadline(timeout_s))[1]


def _full_specs(
    root: Path, real_dir: Path, name: str, manifest: Manifest, deadline: Deadline, reference: TensorSpecs | None = None
) -> tuple[list[str], TensorSpecs]:
    """The shards of a full checkpoint and its tensors' specs, from the shards' headers.

    What a junk step costs is bounded by what the manifest says, and with a ``reference`` by
    the reference: the shards' entries must add up to ``tensor_count`` before any shard is
    read, and each shard's header is counted (:func:`~rollout_service.safetensors_header.count_entries`)
    before safetensors parses it: it must declare exactly the tensors its entry says
    (``bad_manifest``), all of them names of the reference (``extra_tensor``, at the first shard
    that has another). So at most one shard's header is in memory at a time, and only a header
    that holds what it should is parsed, into specs that add up to at most ``tensor_count`` (and
    the reference's count); shapes, dtypes and missing tensors are compared afterwards
    (:func:`compare_specs`).
    """
    shards = sorted(f for f in manifest.files if f.endswith(".safetensors"))
    if not shards:
        raise CheckpointError("missing_file", f"{name}: the manifest lists no .safetensors file")
    listed = sum(manifest.files[f].tensors for f in shards)
    if listed != manifest.tensor_count:
        raise CheckpointError(
            "bad_manifest",
            f"{name}: the manifest's shard entries hold {listed} tensors, tensor_count says {manifest.tensor_count}",
        )
    specs: TensorSpecs = {}
    owner: dict[str, str] = {}
    for fname in shards:
        where = f"{name}/{fname}"
        deadline.check(where)
        want = manifest.files[fname].tensors
        with open_regular(root, real_dir / fname, where=where) as (fd, _):
            file_specs = _specs_of_fd(fd, where, check=_shard_check(where, want, reference))
        if len(file_specs) != want:  # a name given twice: safetensors keeps one
            raise CheckpointError("bad_manifest", f"{where} holds {len(file_specs)} tensors, the manifest says {want}")
        for tname in file_specs:
            if tname in owner:
                raise CheckpointError(
                    "duplicate_tensor", f"{name}: tensor {tname} is in both {owner[tname]} and {fname}"
                )
            owner[tname] = fname
        specs.update(file_specs)
    if len(shards) > 1 or INDEX_NAME in manifest.files:
        _check_index(root, real_dir, name, owner)
    return shards, specs


def _shard_check(where: str, want: int, reference: TensorSpecs | None) -> HeaderCheck:
    """A shard's header must declare ``want`` tensors (``bad_manifest``), every one a name of
    ``reference`` when there is one (``extra_tensor``): counted before it is parsed."""

    def check(header: memoryview) -> None:
        found = count_entries(header, where, limit=want, known=reference)
        if found.unknown:
            more = "" if found.complete else " or more"
            raise CheckpointError(
                "extra_tensor",
                f"{where} has {found.unknown}{more} tensor(s) the reference lacks, e.g. {_some(list(found.examples))}",
            )
        if found.count != want:
            held = found.count if found.complete else f"more than {want}"
            raise CheckpointError("bad_manifest", f"{where} holds {held} tensors, the manifest says {want}")

    return check


def _delta_specs(root: Path, real_dir: Path, name: str, manifest: Manifest, deadline: Deadline) -> TensorSpecs:
    """The specs of the checkpoint a delta rebuilds, after checking its files against them.

    Every ``delta-*.safetensors`` must hold exactly the ``U8`` blobs the manifest assigns to
    it (one per changed tensor: its header is counted against them before it is parsed, as a
    full step's shards are), every target shard must be described, and each target shard's
    size must be its tensors' bytes (from their dtypes and shapes) and a header of at most
    ``MAX_SHARD_HEADER_BYTES``.
    """
    delta = manifest.delta
    assert delta is not None
    if len(delta.tensors) != manifest.tensor_count:
        raise CheckpointError(
            "bad_manifest",
            f"{name}: delta.tensors lists {len(delta.tensors)} tensors, tensor_count says {manifest.tensor_count}",
        )
    expected: dict[str, set[str]] = {}
    per_shard: dict[str, int] = {}
    shard_bytes: dict[str, int] = {}
    specs: TensorSpecs = {}
    for tname, t in delta.tensors.items():
        specs[tname] = (t.dtype, tuple(t.shape))
        per_shard[t.shard] = per_shard.get(t.shard, 0) + 1
        shard_bytes[t.shard] = shard_bytes.get(t.shard, 0) + DTYPE_SIZES[t.dtype] * math.prod(t.shape)
        if t.delta_file is not None:
            if t.delta_file not in manifest.files:
                raise CheckpointError(
                    "bad_manifest",
                    f"{name}: tensor {tname[:80]} names the delta file {t.delta_file}, which is not in files",
                )
            expected.setdefault(t.delta_file, set()).add(tname)
    for shard, count in per_shard.items():
        if delta.target_files[shard].tensors != count:
            raise CheckpointError(
                "bad_manifest",
                f"{name}: target shard {shard} holds {count}"
                f" tensors, its entry says {delta.target_files[shard].tensors}",
            )
        size, data = delta.target_files[shard].size, shard_bytes[shard]
        if not data + 8 < size <= data + 8 + MAX_SHARD_HEADER_BYTES:
            raise CheckpointError(
                "bad_manifest",
                f"{name}: target shard {shard} is {size} bytes by its entry; its tensors hold {data}"
                f" bytes, so it must be a little larger (a header of at most {MAX_SHARD_HEADER_BYTES} bytes)",
            )
    for fname in sorted(f for f in manifest.files if f.endswith(".safetensors")):
        where = f"{name}/{fname}"
        deadline.check(where)
        assigned = expected.get(fname, set())

        def check(header: memoryview, where: str = where, assigned: set[str] = assigned) -> None:
            found = count_entries(header, where, limit=len(assigned), known=assigned)
            if found.unknown or found.count != len(assigned):
                raise CheckpointError("delta_corrupt", f"{where} holds other tensors than the manifest assigns to it")

        with open_regular(root, real_dir / fname, where=where) as (fd, _):
            file_specs = _specs_of_fd(fd, where, check=check)
        if set(file_specs) != assigned:
            raise CheckpointError("delta_corrupt", f"{where} holds other tensors than the manifest assigns to it")
        odd = sorted(k for k, (dt, shape) in file_specs.items() if dt != "U8" or len(shape) != 1)
        if odd:
            raise CheckpointError("delta_corrupt", f"{name}/{fname}: {odd[0]} is not a U8 blob")
        for k, (_, shape) in sorted(file_specs.items()):
            framed = sum(delta.tensors[k].frames or [])
            if shape[0] != framed:
                raise CheckpointError(
                    "delta_corrupt", f"{name}/{fname}: the blob of {k[:80]} has {shape[0]} bytes, its frames {framed}"
                )
    missing = sorted(set(expected) - set(f for f in manifest.files if f.endswith(".safetensors")))
    if missing:
        raise CheckpointError("bad_manifest", f"{name}: delta file {missing[0]} is not a .safetensors file")
    return specs


_READ_CHUNK = 4 << 20
"""Bytes read per ``pread`` by :func:`read_every_byte` (into one reused buffer)."""


def read_every_byte(
    root: Path, path: Path, where: str, want_digest: str, digest: bool, finite: bool, deadline: Deadline
) -> None:
    """Read a file under ``root`` whole: with ``digest`` its xxh3-128 must be ``want_digest``
    (``digest_mismatch``), with ``finite`` its safetensors floats must hold no NaN/Inf
    (``non_finite``).

    The file is read with ``pread`` into one reused buffer, a chunk at a time, never mapped: a
    mapped file that someone truncates while it is read kills the reader with SIGBUS. A file
    that shrinks while it is read raises ``truncated``, one that grows ``size_mismatch``.
    """
    if not (digest or finite):
        return
    with open_regular(root, path, where=where) as (fd, st):
        _scan_fd(fd, st.st_size, where, want_digest, digest, finite, deadline)


def _scan_fd(fd: int, size: int, where: str, want_digest: str, digest: bool, finite: bool, deadline: Deadline) -> None:
    hasher = new_hasher() if digest else None
    scanner = _FiniteScanner(fd, size, where, min(_READ_CHUNK, size)) if finite else None
    view = memoryview(bytearray(min(_READ_CHUNK, size)))
    offset = 0
    while offset < size:
        deadline.check(where)
        chunk = view[: min(len(view), size - offset)]
        _pread_exactly(fd, chunk, offset, where, size)
        if hasher is not None:
            hasher.update(chunk)
        if scanner is not None:
            scanner.feed(offset, chunk)
        offset += len(chunk)
    if _pread(fd, memoryview(bytearray(1)), size, where):
        raise CheckpointError(
            "size_mismatch",
            f"{where} grew while it was being read: it had {size} bytes when opened, now more;"
            " the writer modified a published file",
        )
    if hasher is not None:
        found = format_digest(hasher)
        if found != want_digest:
            raise CheckpointError(
                "digest_mismatch",
                f"{where} has digest {found}, the manifest says {want_digest}:"
                " the file's bytes changed after publishing",
            )
    if scanner is not None:
        bad = scanner.first_bad()
        if bad is not None:
            raise CheckpointError(
                "non_finite",
                f"{where}: tensor {bad[0]} holds {bad[1]} NaN/Inf value(s); SGLang would"
                " load it and generate garbage. Check the training run for divergence",
            )


def _pread(fd: int, into: memoryview, offset: int, where: str) -> int:
    try:
        return os.preadv(fd, [into], offset)
    except OSError as exc:
        raise unreadable(exc, f"{where}: reading at byte {offset} failed: {exc.strerror}") from None


def _pread_exactly(fd: int, into: memoryview, offset: int, where: str, size: int) -> None:
    """Fill ``into`` from ``offset``; a file that ends first was cut while it was read."""
    got = 0
    while got < len(into):
        n = _pread(fd, into[got:], offset + got, where)
        if not n:
            raise CheckpointError(
                "truncated",
                f"{where} was truncated while it was being read: it ends at byte {offset + got},"
                f" it had {size} bytes when opened; the writer modified a published file",
            )
        got += n


class _FiniteScanner:
    """Counts NaN/Inf in a safetensors file's floating tensors as its bytes stream past.

    The header is read first (its own ``pread``); then :meth:`feed` takes consecutive chunks of
    the file and counts each tensor's elements in them. An element cut by a chunk boundary is
    carried over (at most 7 bytes) and counted whole with the next chunk.
    """

    def __init__(self, fd: int, size: int, where: str, chunk: int):
        self.segments = self._read_header(fd, size, where)  # (start, end, dtype, element size, name)
        self.counts: dict[str, int] = {}
        self.scratch = np.empty(chunk, dtype=np.uint8)
        self.i = 0
        self.carry = b""

    @staticmethod
    def _read_header(fd: int, size: int, where: str) -> list[tuple[int, int, str, int, str]]:
        try:
            entries = read_header(fd, size, where).entries
        except CheckpointError as exc:
            raise CheckpointError(exc.reason, f"{exc}; the file is corrupt or was modified after publishing") from None
        return [
            (e.start, e.end, e.dtype, DTYPE_SIZES[e.dtype], e.name)
            for e in entries
            if e.dtype in FLOAT_DTYPES and e.nbytes
        ]

    def feed(self, offset: int, chunk: memoryview) -> None:
        """Count the NaN/Inf values in ``chunk``, the file's bytes from ``offset`` on."""
        end = offset + len(chunk)
        while self.i < len(self.segments):
            start, stop, dtype, elsize, name = self.segments[self.i]
            if start >= end:
                return
            lo, hi = max(start, offset), min(stop, end)
            if lo < hi:
                self._count(chunk[lo - offset : hi - offset], dtype, elsize, name)
            if stop > end:
                return
            self.i += 1
            self.carry = b""  # a tensor's bytes that are no whole element (not from safetensors' writer)

    def _count(self, piece: memoryview, dtype: str, elsize: int, name: str) -> None:
        found = 0
        if self.carry:
            need = elsize - len(self.carry)
            element = self.carry + bytes(piece[:need])
            piece = piece[need:]
            if len(element) < elsize:
                self.carry = element
                return
            self.carry = b""
            found += count_non_finite(element, dtype)
        whole = len(piece) - len(piece) % elsize
        found += count_non_finite(piece[:whole], dtype, self.scratch)
        self.carry = bytes(piece[whole:])
        if found:
            self.counts[name] = self.counts.get(name, 0) + found

    def first_bad(self) -> tuple[str, int] | None:
        """``(tensor name, count of NaN/Inf values)`` of the first tensor by name that has any."""
        bad = sorted(self.counts.items())
        return bad[0] if bad else None


def _check_index(root: Path, real_dir: Path, name: str, owner: dict[str, str]) -> None:
    where = f"{name}/{INDEX_NAME}"
    try:
        raw = read_small(root, real_dir / INDEX_NAME, where=where)
    except CheckpointError as exc:
        if exc.reason == "missing_file":
            raise CheckpointError("missing_file", f"{name} is sharded but has no {INDEX_NAME}") from None
        raise
    data = parse_json_object(raw, where=where, reason="index_mismatch")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            "index_mismatch", f"{where}: weight_map must be an object of tensor name -> shard file name"
        )
    if weight_map != owner:
        diff = sorted(set(weight_map.items()) ^ set(owner.items()))
        raise CheckpointError(
            "index_mismatch",
            f"{where} does not match the shards' contents, e.g. {diff[:2]}",
        )
