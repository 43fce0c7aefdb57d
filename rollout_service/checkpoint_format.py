"""The one definition of a published checkpoint, shared by writer and reader.

A checkpoint root holds::

    <root>/step-00000012/        one published checkpoint (never partial)
        model.safetensors        or model-0000i-of-0000N.safetensors shards
        model.safetensors.index.json   only when sharded
        config.json
        manifest.json            written last; describes every other file
    <root>/LATEST                name of the newest published step directory
    <root>/.tmp-step-...         a writer's private work area (never read)
    <root>/acks/<replica>.json   sidecar acknowledgements

A ``step-*`` directory appears only by an atomic rename of a complete temporary
directory, so a reader that sees it sees all of it.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
LATEST_NAME = "LATEST"
ACKS_DIR = "acks"
TEMP_PREFIX = ".tmp-"
STEP_DIR_RE = re.compile(r"^step-(\d{8})$")
DIGEST_ALGORITHM = "xxh3_128"
MAX_STEP = 10**8 - 1

# safetensors dtype tags, and the element size of each.
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
# The dtype names users pass (config, CLI) mapped to safetensors tags.
DTYPE_NAMES = {
    "float32": "F32", "fp32": "F32", "float16": "F16", "fp16": "F16", "half": "F16",
    "bfloat16": "BF16", "bf16": "BF16", "float64": "F64",
}


class CheckpointError(ValueError):
    """A checkpoint is unusable. ``reason`` is a short stable code for metrics and logs."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def step_dir_name(step: int) -> str:
    """``step-00000012`` for step 12; rejects steps that do not fit in 8 digits."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an integer between 0 and {MAX_STEP}, got {step!r}")
    return f"step-{step:08d}"


def parse_step_dir_name(name: str) -> int | None:
    """The step of a ``step-XXXXXXXX`` directory name, or None for any other name."""
    match = STEP_DIR_RE.match(name)
    return int(match.group(1)) if match else None


def weight_version_for_step(step: int) -> str:
    """The weight version string SGLang is given for a step (what completions carry)."""
    return str(step)


def normalize_dtype(dtype: str | None) -> str | None:
    """Map a user dtype name (``bfloat16``, ``bf16``, ``BF16``) to its safetensors tag."""
    if dtype is None:
        return None
    if dtype in FLOAT_DTYPES:
        return dtype
    tag = DTYPE_NAMES.get(str(dtype).lower().removeprefix("torch."))
    if tag is None:
        raise ValueError(
            f"unknown checkpoint dtype {dtype!r}; use one of {sorted(set(DTYPE_NAMES))}"
        )
    return tag


@dataclass
class FileEntry:
    """One file of a checkpoint as recorded in its manifest."""

    size: int
    digest: str
    tensors: int = 0


@dataclass
class Manifest:
    """Contents of ``manifest.json``: what a reader needs to trust a checkpoint."""

    step: int
    weight_version: str
    created_at: float
    writer: dict[str, Any]
    base_model: str | None
    dtype: str | None
    total_bytes: int
    tensor_count: int
    files: dict[str, FileEntry]
    digest_algorithm: str = DIGEST_ALGORITHM
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, *, where: str = "manifest.json") -> "Manifest":
        """Parse a manifest; any structural problem raises ``CheckpointError('bad_manifest')``."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CheckpointError("bad_manifest", f"{where} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise CheckpointError("bad_manifest", f"{where} must hold a JSON object")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(
                "bad_manifest",
                f"{where} has format_version {version!r}; this reader understands {FORMAT_VERSION}."
                " Upgrade rollout-service on the reading side.",
            )
        required = ["step", "weight_version", "created_at", "writer", "base_model", "dtype",
                    "total_bytes", "tensor_count", "files", "digest_algorithm"]
        missing = [k for k in required if k not in data]
        if missing:
            raise CheckpointError("bad_manifest", f"{where} lacks the field(s) {missing}")
        try:
            files = {
                str(name): FileEntry(size=int(e["size"]), digest=str(e["digest"]),
                                     tensors=int(e.get("tensors", 0)))
                for name, e in dict(data["files"]).items()
            }
            return cls(
                step=int(data["step"]), weight_version=str(data["weight_version"]),
                created_at=float(data["created_at"]), writer=dict(data["writer"]),
                base_model=data["base_model"], dtype=data["dtype"],
                total_bytes=int(data["total_bytes"]), tensor_count=int(data["tensor_count"]),
                files=files, digest_algorithm=str(data["digest_algorithm"]),
                format_version=version, extra=dict(data.get("extra") or {}),
            )
        except (TypeError, ValueError, KeyError) as exc:
            raise CheckpointError("bad_manifest", f"{where} has a malformed field: {exc!r}") from exc

    @classmethod
    def load(cls, checkpoint_dir: Path) -> "Manifest":
        path = Path(checkpoint_dir) / MANIFEST_NAME
        try:
            text = path.read_text()
        except FileNotFoundError as exc:
            raise CheckpointError(
                "missing_manifest",
                f"{path} does not exist: {checkpoint_dir} is not a published checkpoint"
                " (publish with `rollout-service publish` or trainer_hooks)",
            ) from exc
        return cls.from_json(text, where=str(path))
