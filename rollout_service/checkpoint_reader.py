"""Listing and validating published checkpoints (the reader side of the format).

Validation reads only headers (safetensors' own parser, with numpy, no torch), so
the slim sidecar can run it. Each failure raises
:class:`~rollout_service.checkpoint_format.CheckpointError` with its own
``reason`` code and a message that names the file and what was wrong.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open

from .checkpoint_format import (
    CONFIG_NAME, FLOAT_DTYPES, INDEX_NAME, LATEST_NAME, MANIFEST_NAME, CheckpointError, Manifest,
    parse_step_dir_name,
)
from .checkpoint_paths import check_plain_file_name, resolve_inside
from .digest import file_digest

TensorSpecs = dict[str, tuple[str, tuple[int, ...]]]
"""tensor name -> (safetensors dtype tag, shape)"""


@dataclass(frozen=True)
class PublishedCheckpoint:
    """A ``step-*`` directory found under a checkpoint root (not yet validated)."""

    step: int
    path: Path


@dataclass
class ValidationReport:
    """A checkpoint that passed validation, with what was checked."""

    path: Path
    manifest: Manifest
    specs: TensorSpecs
    digests_checked: bool
    checks: list[str] = field(default_factory=list)


def list_checkpoints(root: Path | str) -> list[PublishedCheckpoint]:
    """Published checkpoints under ``root`` in step order. Hidden and other entries are ignored."""
    root = Path(root)
    found = []
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    for entry in entries:
        step = parse_step_dir_name(entry.name)
        if step is not None and entry.is_dir():
            found.append(PublishedCheckpoint(step=step, path=root / entry.name))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(root: Path | str) -> PublishedCheckpoint | None:
    """The highest-step published checkpoint (the directory listing is the truth, not LATEST)."""
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_safetensors_specs(path: Path) -> TensorSpecs:
    """Tensor names, dtypes and shapes of one safetensors file, from its header only.

    safetensors rejects a header that does not cover the file exactly, which is the
    same check that makes SGLang crash on a truncated file.
    """
    try:
        with safe_open(str(path), framework="numpy") as f:
            return {k: (str(f.get_slice(k).get_dtype()), tuple(f.get_slice(k).get_shape()))
                    for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types from Rust
        raise CheckpointError(
            "header_invalid",
            f"{path.name}: the safetensors header does not describe the file ({exc});"
            " the file is corrupt or was modified after publishing",
        ) from exc


def read_model_specs(model_dir: Path | str) -> TensorSpecs:
    """Tensor specs of every ``*.safetensors`` file in a model or checkpoint directory."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors files to compare against")
    specs: TensorSpecs = {}
    for path in files:
        specs.update(read_safetensors_specs(path))
    return specs


def compare_specs(found: TensorSpecs, expected: TensorSpecs, *, where: str,
                  allow_float_cast: bool = False) -> None:
    """Raise on the first difference in tensor names, shapes or dtypes."""
    missing = sorted(set(expected) - set(found))
    if missing:
        raise CheckpointError(
            "missing_tensor",
            f"{where} lacks {len(missing)} tensor(s) the reference has, e.g. {missing[:3]}",
        )
    extra = sorted(set(found) - set(expected))
    if extra:
        raise CheckpointError(
            "extra_tensor",
            f"{where} has {len(extra)} tensor(s) the reference lacks, e.g. {extra[:3]}",
        )
    for name in sorted(expected):
        dtype, shape = found[name]
        want_dtype, want_shape = expected[name]
        if shape != want_shape:
            raise CheckpointError(
                "shape_mismatch",
                f"{where}: tensor {name} has shape {list(shape)}, the reference has {list(want_shape)}",
            )
        if dtype != want_dtype and not (
            allow_float_cast and dtype in FLOAT_DTYPES and want_dtype in FLOAT_DTYPES
        ):
            raise CheckpointError(
                "dtype_mismatch",
                f"{where}: tensor {name} has dtype {dtype}, the reference has {want_dtype}",
            )


def validate_checkpoint(
    checkpoint_dir: Path | str,
    *,
    root: Path | str | None = None,
    reference: TensorSpecs | None = None,
    allow_float_cast: bool = False,
    check_digests: bool = False,
) -> ValidationReport:
    """Check that ``checkpoint_dir`` is a complete, self-consistent published checkpoint.

    ``root`` confines every path (default: the checkpoint's parent directory).
    ``reference`` (see :func:`read_model_specs`) must match tensor names, shapes
    and dtypes; ``allow_float_cast`` accepts a different floating dtype (SGLang
    casts on load). ``check_digests`` re-reads every byte and compares digests.
    """
    checkpoint_dir = Path(checkpoint_dir)
    root = Path(root) if root is not None else checkpoint_dir.parent
    real_dir = resolve_inside(root, checkpoint_dir)
    if not real_dir.is_dir():
        raise CheckpointError("missing_checkpoint", f"{checkpoint_dir} is not a directory")
    name = checkpoint_dir.name
    checks = ["inside root"]
    manifest = Manifest.load(real_dir)
    checks.append("manifest parses")
    step = parse_step_dir_name(name)
    if step is not None and manifest.step != step:
        raise CheckpointError(
            "bad_manifest", f"{name}/manifest.json says step {manifest.step}, the directory says {step}"
        )
    for fname in manifest.files:
        check_plain_file_name(fname, f"{name}/manifest.json")
    # Files SGLang would load but the manifest does not vouch for.
    for entry in os.scandir(real_dir):
        if entry.name.endswith(".safetensors") and entry.name not in manifest.files:
            raise CheckpointError(
                "unlisted_file",
                f"{name}/{entry.name} is not in the manifest; SGLang would load it."
                " Remove it or republish the checkpoint",
            )
    total = 0
    for fname, entry in sorted(manifest.files.items()):
        path = real_dir / fname
        if path.is_symlink():
            resolve_inside(root, path)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(
                "missing_file", f"{name}/{fname} is listed in the manifest but does not exist"
            ) from None
        if size < entry.size:
            raise CheckpointError(
                "truncated",
                f"{name}/{fname} is truncated: {size} bytes on disk, the manifest says {entry.size}",
            )
        if size != entry.size:
            raise CheckpointError(
                "size_mismatch",
                f"{name}/{fname} has {size} bytes on disk, the manifest says {entry.size}",
            )
        total += size
    if total != manifest.total_bytes:
        raise CheckpointError(
            "size_mismatch",
            f"{name}: files add up to {total} bytes, manifest total_bytes says {manifest.total_bytes}",
        )
    checks.append("every file present with its manifest size")
    shards = sorted(f for f in manifest.files if f.endswith(".safetensors"))
    if not shards:
        raise CheckpointError("missing_file", f"{name}: the manifest lists no .safetensors file")
    if CONFIG_NAME not in manifest.files:
        raise CheckpointError("missing_file", f"{name}: the manifest lists no {CONFIG_NAME}")
    specs: TensorSpecs = {}
    owner: dict[str, str] = {}
    for fname in shards:
        file_specs = read_safetensors_specs(real_dir / fname)
        if len(file_specs) != manifest.files[fname].tensors:
            raise CheckpointError(
                "bad_manifest",
                f"{name}/{fname} holds {len(file_specs)} tensors, the manifest says"
                f" {manifest.files[fname].tensors}",
            )
        for tname in file_specs:
            if tname in owner:
                raise CheckpointError(
                    "duplicate_tensor", f"{name}: tensor {tname} is in both {owner[tname]} and {fname}"
                )
            owner[tname] = fname
        specs.update(file_specs)
    checks.append("safetensors headers cover their files")
    if len(specs) != manifest.tensor_count:
        raise CheckpointError(
            "bad_manifest",
            f"{name}: shards hold {len(specs)} tensors, the manifest says {manifest.tensor_count}",
        )
    if manifest.dtype is not None:
        odd = sorted(k for k, (dt, _) in specs.items() if dt in FLOAT_DTYPES and dt != manifest.dtype)
        if odd:
            raise CheckpointError(
                "dtype_mismatch",
                f"{name}: tensor {odd[0]} has dtype {specs[odd[0]][0]}, the manifest says every"
                f" floating tensor is {manifest.dtype}",
            )
    if len(shards) > 1 or INDEX_NAME in manifest.files:
        _check_index(real_dir, name, owner)
        checks.append("index matches shards")
    if reference is not None:
        compare_specs(specs, reference, where=name, allow_float_cast=allow_float_cast)
        checks.append("tensor names, shapes and dtypes match the reference")
    if check_digests:
        for fname, entry in sorted(manifest.files.items()):
            digest = file_digest(real_dir / fname)
            if digest != entry.digest:
                raise CheckpointError(
                    "digest_mismatch",
                    f"{name}/{fname} has digest {digest}, the manifest says {entry.digest}:"
                    " the file's bytes changed after publishing",
                )
        checks.append("digests match")
    return ValidationReport(path=real_dir, manifest=manifest, specs=specs,
                            digests_checked=check_digests, checks=checks)


def _check_index(real_dir: Path, name: str, owner: dict[str, str]) -> None:
    path = real_dir / INDEX_NAME
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except FileNotFoundError:
        raise CheckpointError("missing_file", f"{name} is sharded but has no {INDEX_NAME}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError("index_mismatch", f"{name}/{INDEX_NAME} is malformed: {exc!r}") from exc
    if weight_map != owner:
        diff = sorted(set(weight_map.items()) ^ set(owner.items()))
        raise CheckpointError(
            "index_mismatch",
            f"{name}/{INDEX_NAME} does not match the shards' contents, e.g. {diff[:2]}",
        )


def read_latest_pointer(root: Path | str) -> int | None:
    """The step named by ``LATEST`` (a hint; the listing is authoritative)."""
    try:
        return parse_step_dir_name((Path(root) / LATEST_NAME).read_text().strip())
    except OSError:
        return None
