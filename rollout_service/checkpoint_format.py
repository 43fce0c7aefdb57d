"""The one definition of a published checkpoint, shared by writer and reader.

A checkpoint root holds::

    <root>/step-00000012/        one published checkpoint (never partial)
        model.safetensors        or model-0000i-of-0000N.safetensors shards
        model.safetensors.index.json   only when sharded
        config.json
        manifest.json            written last; describes every other file
    <root>/.tmp-step-...         a writer's private work area (never read)
    <root>/acks/<replica>.json   sidecar acknowledgements

A ``step-*`` directory appears only by an atomic rename of a complete temporary
directory, so a reader that sees it sees all of it: that rename is the one completion
signal (there is no ``LATEST`` pointer; the listing is the truth).

A published step has a *kind* (manifest ``kind``):

- ``full``: the model's safetensors shards, loadable as they are.
- ``delta``: what changed since the previous published step (``delta.base_step``, whose
  manifest fingerprint is ``delta.base_fingerprint``), in a chain that starts at the full
  step ``delta.chain_start``. ``delta-*.safetensors`` hold, per changed tensor, a ``U8``
  tensor of the same name: ``zstd(new bytes XOR base bytes)`` (standard tools open them).
  ``delta.target_files`` are the files a full publish of the same weights would have
  written (shards, index, config: size and xxh3-128 each) and ``delta.tensors`` give every
  tensor's dtype, shape, shard and the digest of its new bytes, so a reconstruction is
  checked bit for bit. The shard layout is the base's: a delta is only written when
  names, shapes, dtypes and their order are unchanged.
- ``adapter``: a PEFT LoRA adapter (``adapter_model.safetensors`` + ``adapter_config.json``)
  for the base model the replicas were started with; ``adapter`` gives its rank, alpha and
  target modules (the sidecar checks them against the served model before SGLang sees them).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .number_text import MAX_STEP_DIGITS
from .shown_values import shown_text

FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
"""1: full checkpoints only (no ``kind`` field); 2: ``kind`` full, delta or adapter."""
KINDS = ("full", "delta", "adapter")
DELTA_CODEC = "xor+zstd-frames"
"""A changed tensor's blob is ``zstd(new bytes XOR base bytes)``, one zstd frame per
``frame_bytes`` of the tensor (each declares its size), so that encode and rebuild run a big
tensor on several threads; a part that did not change has no frame. (The first delta writer's
``xor+zstd``, one frame per tensor, is refused with a reason: the next full step recovers.)"""
DELTA_FRAME_BYTES = 16 << 20
"""What the writer uses: 1 GB embeddings make 64 frames, small enough to stay in cache."""
MIN_FRAME_BYTES, MAX_FRAME_BYTES = 1 << 20, 1 << 26
"""Frame sizes a reader accepts (powers of two: a frame holds whole elements of any dtype): it
holds two buffers of one frame per apply thread. Each part costs a job and its bookkeeping
(~2.6 KB and 0.4 ms measured): 4 KiB frames made a crafted delta of a 256 MiB tensor take 27 s
and 208 MB to refuse or rebuild (65,536 parts); at 1 MiB a 7B model is 14,000 parts."""
DEFAULT_FULL_EVERY = 20
"""A full checkpoint every 20 versions: see docs/benchmarks.md (delta sync) for the measured
trade-off between bytes per sync and a late joiner's replay."""
MAX_SHARD_HEADER_BYTES = 100 << 20
"""The largest safetensors header of a shard a reader accepts (names, dtypes, shapes, offsets:
~30 KB for a 7B model)."""
MAX_ADAPTER_HEADER_BYTES = 16 << 20
"""The largest safetensors header of an adapter's weights a reader accepts (16 MiB), checked from
its length field before any of it is read, and refused by the writer before anything is
published. A LoRA adapter's header holds ~100 bytes per tensor (name, dtype, shape, offsets) and
two tensors per adapted module: an 80-layer model with 7 target modules has 1,120 tensors,
~112 KB; all-linear LoRA on every expert of a 48-layer, 128-expert MoE has ~37k, ~4-5 MB. A header
at 4 MiB parses in 0.13 s (~24 MB); the full-model cap (100 MB) let a crafted adapter's header of
820k entries take 5.4 s and ~860 MB before it was rejected."""
MAX_CHAIN_LENGTH = 1000
"""The most deltas one chain may hold (so the largest ``checkpoint_full_every`` is 1001): a
replica that joins late replays a chain from its full step, and a reader walks it under a deadline."""
MAX_CHAIN_FRAMES = 1 << 22
"""The most frame sizes the manifests of one chain may list in all: a walk holds every link's
manifest until it is applied. The writer's 16 MiB frames make ~900 per link for a 7B bf16 model
(1000 links: 0.9M) and ~8,300 for 70B (a chain of up to ~500 links); a chain of 4 KiB frames
(one manifest of a 1 GiB model lists 262k) is refused after 16 links instead of holding ~2 MiB of
parsed manifest per link, up to 2 GB."""
MAX_CHAIN_FREE_TEXT = 4 << 20
"""The most characters of free-form JSON (``writer``, ``extra``) the manifests of one chain may
hold in all. Each may hold a tree of 10,000 nodes and 64 KiB of text, ~2.2 MB once parsed: 1,000
such links held ~2.2 GB (3.5 GB RSS) in a walk. The writer puts ~200 characters there per link."""
MAX_CHAIN_TENSORS = 1 << 19
"""The most tensor entries the manifests of one chain may list in all (each link lists every
tensor of the model, changed or not; ~600 bytes each once parsed, so ~300 MB at most). A 7B
model lists ~340 per link and a 70B ~1,000 (chains of up to ~500 links); a model of 100,000
tensors (MoE experts stored one by one) gets chains of 5 links. The writer starts a new chain
before this, as for :data:`MAX_CHAIN_FRAMES`."""


def frame_bound(part_bytes: int) -> int:
    """The most bytes a zstd frame of ``part_bytes`` bytes may take: above zstd's worst case
    (``ZSTD_compressBound``: the part + 1/256 + 64 bytes for small parts, with a frame's header
    and checksum)."""
    return part_bytes + (part_bytes >> 7) + 1024


MAX_CHAIN_NAME_CHARS = 64 << 20
"""The most characters of names (each tensor entry's tensor, shard and delta file names) the
manifests of one chain may hold in all: the tensor entries' count is bounded above, their names'
length is not (a 15 MB name fits a manifest, and every link holds its own copy: ~16 GB for 1,000
links). A 7B model's names take ~35 k per link (1,000 links: 35 M); the writer starts a new chain
before this, estimating :data:`FILE_NAME_CHARS` for each file name."""
FILE_NAME_CHARS = 64
"""What the writer counts for each shard or delta file name a tensor entry holds (its own are 32)."""
DEFAULT_DELTA_MAX_RATIO = 0.5
MANIFEST_NAME = "manifest.json"
CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_FILES = (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME)
"""The files of an ``adapter`` step (PEFT's ``save_pretrained`` names), and no others."""
MAX_ADAPTER_RANK = 4096
ACKS_DIR = "acks"
TEMP_PREFIX = ".tmp-"
STEP_DIR_RE = re.compile(rf"^step-([0-9]{{{MAX_STEP_DIGITS}}})$", re.ASCII)  # not \d: other scripts' digits
DIGEST_ALGORITHM = "xxh3_128"
MAX_STEP = 10**MAX_STEP_DIGITS - 1

# safetensors dtype tags, and the element size of each.
DTYPE_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
# The dtype names users pass (config, CLI) mapped to safetensors tags.
DTYPE_NAMES = {
    "float32": "F32",
    "fp32": "F32",
    "float16": "F16",
    "fp16": "F16",
    "half": "F16",
    "bfloat16": "BF16",
    "bf16": "BF16",
    "float64": "F64",
}
DTYPE_NAME_OF_TAG = {tag: name for name, tag in DTYPE_NAMES.items() if name.startswith(("float", "bfloat"))}
"""torch's name of each tag in :data:`DTYPE_NAMES` (its spelled-out name there: ``BF16`` -> ``bfloat16``)."""


MAX_ERROR_CHARS = 4096
"""A :class:`CheckpointError`'s message is cut here: it quotes untrusted names (a tensor named by
100,000 characters), and goes into logs, ``/status`` and the replica's ack file."""


class CheckpointError(ValueError):
    """A checkpoint is unusable. ``reason`` is a short stable code for metrics and logs.

    The message quotes names from the untrusted root: it is cut to :data:`MAX_ERROR_CHARS` and its
    control characters (a newline, ESC, ``\\u2028``) are escaped (``shown_values.shown_text``), so
    it is one line that forges no log line and moves no terminal cursor wherever it is shown."""

    def __init__(self, reason: str, message: str):
        super().__init__(shown_text(message, MAX_ERROR_CHARS))
        self.reason = reason


def step_dir_name(step: int) -> str:
    """``step-00000012`` for step 12; rejects steps that do not fit in 8 digits."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ValueError(f"step must be an integer between 0 and {MAX_STEP}, got {step!r}")
    return f"step-{step:08d}"


def refuse_step_link(checkpoint_dir: Path) -> None:
    """Raise ``not_a_checkpoint`` when ``checkpoint_dir`` is named like a step and is a symbolic
    link. A published step is the folder its writer renamed into place; the trainer's numbering
    and retention never count a link, so a reader that followed one could serve a step the
    trainer does not know of (``ln -s x step-00000099`` would pin every replica to it)."""
    if parse_step_dir_name(checkpoint_dir.name) is not None and os.path.islink(checkpoint_dir):
        raise CheckpointError(
            "not_a_checkpoint",
            f"{checkpoint_dir.name} is a symbolic link; a published step is the folder its writer renamed"
            " into place, and links named like steps are not followed. Remove the link (materialize a"
            " version to evaluate it elsewhere)",
        )


def parse_step_dir_name(name: str) -> int | None:
    """The step of a ``step-XXXXXXXX`` directory name, or None for any other name."""
    match = STEP_DIR_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def new_run_id() -> str:
    """A fresh lineage id for one training run's checkpoints."""
    return uuid.uuid4().hex


def normalize_dtype(dtype: str | None) -> str | None:
    """Map a user dtype name (``bfloat16``, ``bf16``, ``BF16``) to its safetensors tag."""
    if dtype is None:
        return None
    if dtype in FLOAT_DTYPES:
        return dtype
    tag = DTYPE_NAMES.get(str(dtype).lower().removeprefix("torch."))
    if tag is None:
        raise ValueError(f"unknown checkpoint dtype {dtype!r}; use one of {sorted(set(DTYPE_NAMES))}")
    return tag


@dataclass
class FileEntry:
    """One file of a checkpoint as recorded in its manifest."""

    size: int
    digest: str
    tensors: int = 0


@dataclass
class DeltaTensor:
    """One tensor of the checkpoint a delta reconstructs."""

    shard: str
    """The target shard file the tensor lives in."""
    dtype: str
    shape: list[int]
    digest: str
    """xxh3-128 of the tensor's new bytes."""
    delta_file: str | None = None
    """The ``delta-*.safetensors`` file holding its XOR blob; None when it did not change."""
    frames: list[int] | None = None
    """With ``delta_file``: the compressed size of each frame of the blob, in order; frame i
    is the XOR of bytes ``[i * frame_bytes, (i + 1) * frame_bytes)``, 0 where they did not change."""


@dataclass
class DeltaInfo:
    """What a ``delta`` step applies to and what it reconstructs."""

    base_step: int
    base_fingerprint: str
    chain_start: int
    target_files: dict[str, FileEntry]
    tensors: dict[str, DeltaTensor]
    codec: str = DELTA_CODEC
    frame_bytes: int = DELTA_FRAME_BYTES
    changed_tensors: int = 0
    changed_bytes: int = 0
    """Bytes of the changed tensors (uncompressed), for reports."""


@dataclass
class AdapterInfo:
    """What an ``adapter`` step holds: one PEFT LoRA adapter (``peft_type`` ``LORA``)."""

    rank: int
    alpha: float
    target_modules: list[str]
    """Module names (``q_proj``, ...) the adapter changes, as in ``adapter_config.json``."""
    peft_type: str = "LORA"
    base_values: dict[str, BaseTensor] | None = None
    """A few of the base model's tensors, by checkpoint name (at most ``MAX_BASE_VALUES``; see
    :mod:`~rollout_service.base_values`): which base the adapter was trained on. None: not
    recorded (nothing is compared)."""


@dataclass
class BaseTensor:
    """One base tensor an adapter step records: the dtype the trainer held it in and the digest
    of its values (:func:`rollout_service.base_values.values_digest`)."""

    dtype: str
    """One of ``BASE_TENSOR_DTYPES``: a reader casts the served model's values to it first."""
    digest: str


MAX_BASE_VALUES = 8
"""The most base tensors an adapter step's manifest may name in ``adapter.base_values``."""
BASE_TENSOR_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})


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
    run_id: str | None = None
    """The publishing run's lineage id: step numbers only order checkpoints of one run."""
    kind: str = "full"
    delta: DeltaInfo | None = None
    adapter: AdapterInfo | None = None

    def to_json(self) -> str:
        data = asdict(self)
        if self.delta is None:
            data.pop("delta")
        if self.adapter is None:
            data.pop("adapter")
        elif self.adapter.base_values is None:
            data["adapter"].pop("base_values")
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def fingerprint(self) -> str:
        """Identity of one publication: the same step republished has another fingerprint."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:32]

    def source_fingerprint(self) -> str:
        """The fingerprint of the *published* manifest this one stands for: a full copy rebuilt
        from a delta names the delta's (``extra.reconstructed_from``); any other is its own."""
        source = self.extra.get("reconstructed_from")
        if isinstance(source, dict):
            fp = source.get("fingerprint")
            if isinstance(fp, str) and _FINGERPRINT_RE.fullmatch(fp):
                return fp
        return self.fingerprint()

    def as_copy(self) -> Manifest:
        """The manifest a verified copy of this published step carries (in a stage, in
        ``materialize``): it stands for this manifest. Only a manifest that names a source itself
        (a materialized step published again) changes: its copy names this one instead, so that
        the copy's :meth:`source_fingerprint` is this publication's fingerprint."""
        if "reconstructed_from" not in self.extra:
            return self
        source = {"fingerprint": self.fingerprint(), "kind": self.kind}
        return replace(self, extra={**self.extra, "reconstructed_from": source})

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = "manifest.json") -> Manifest:
        """Parse a manifest strictly; any problem raises ``CheckpointError('bad_manifest')``.

        The text is untrusted: non-UTF-8 bytes, NaN/Infinity, deep nesting, wrong JSON types,
        booleans or floats where integers belong and out-of-range numbers are all refused.
        """
        data = parse_json_object(text, where=where, reason="bad_manifest")
        try:
            return cls._from_data(data, where)
        except CheckpointError:
            raise
        except (TypeError, ValueError, OverflowError, KeyError, AttributeError, RecursionError) as exc:
            # A check above missed a shape of bad input: it is still this manifest's rejection,
            # never an exception that stops the reader's caller (a sidecar's loop).
            raise CheckpointError(
                "bad_manifest", f"{where}: a field this reader cannot use ({type(exc).__name__}: {str(exc)[:200]})"
            ) from None

    @classmethod
    def _from_data(cls, data: dict[str, Any], where: str) -> Manifest:
        version = data.get("format_version")
        if version not in READABLE_FORMAT_VERSIONS or isinstance(version, bool):
            raise CheckpointError(
                "bad_manifest",
                f"{where} has format_version {str(version)[:40]!r}; this reader understands"
                f" {list(READABLE_FORMAT_VERSIONS)}. Upgrade rollout-service on the reading side.",
            )
        required = [
            "step",
            "weight_version",
            "created_at",
            "writer",
            "base_model",
            "dtype",
            "total_bytes",
            "tensor_count",
            "files",
            "digest_algorithm",
        ]
        missing = [k for k in required if k not in data]
        if missing:
            raise CheckpointError("bad_manifest", f"{where} lacks the field(s) {missing}")
        field_of = _FieldReader(where)
        files_raw = field_of.obj(data["files"], "files")
        if len(files_raw) > MAX_MANIFEST_FILES:
            raise CheckpointError(
                "bad_manifest", f"{where} lists {len(files_raw)} files, more than the {MAX_MANIFEST_FILES} allowed"
            )
        files = field_of.files(files_raw, "files")
        kind = data.get("kind", "full")
        if kind not in KINDS:
            raise CheckpointError("bad_manifest", f"{where}: kind {str(kind)[:40]!r} is not one of {list(KINDS)}")
        delta = None
        if kind == "delta":
            delta = field_of.delta(data.get("delta"))
            if (
                delta.base_step >= field_of.integer(data["step"], "step", MAX_STEP)
                or delta.chain_start > delta.base_step
            ):
                raise CheckpointError(
                    "bad_manifest", f"{where}: a delta must apply to an earlier step (chain_start <= base_step < step)"
                )
            _check_delta_files(delta, files, where)
        elif data.get("delta") is not None:
            raise CheckpointError("bad_manifest", f"{where}: a {kind} checkpoint has no delta field")
        adapter = None
        if kind == "adapter":
            adapter = field_of.adapter(data.get("adapter"))
        elif data.get("adapter") is not None:
            raise CheckpointError("bad_manifest", f"{where}: a {kind} checkpoint has no adapter field")
        dtype = data["dtype"]
        if dtype is not None and not (isinstance(dtype, str) and dtype in FLOAT_DTYPES):
            raise CheckpointError(
                "bad_manifest", f"{where}: dtype {str(dtype)[:40]!r} is not one of {sorted(FLOAT_DTYPES)}"
            )
        run_id = data.get("run_id")
        if run_id is not None and not (isinstance(run_id, str) and RUN_ID_RE.fullmatch(run_id)):
            raise CheckpointError("bad_manifest", f"{where}: run_id must be 1-64 letters, digits, '_' or '-'")
        base_model = data["base_model"]
        if base_model is not None and not (isinstance(base_model, str) and len(base_model) <= MAX_BASE_MODEL_CHARS):
            raise CheckpointError(
                "bad_manifest",
                f"{where}: base_model must be null or a string of at most {MAX_BASE_MODEL_CHARS} characters",
            )
        digest_algorithm = data["digest_algorithm"]
        if digest_algorithm != DIGEST_ALGORITHM:
            raise CheckpointError("bad_manifest", f"{where}: digest_algorithm must be {DIGEST_ALGORITHM!r}")
        created_at = data["created_at"]
        # Compared before any conversion: float() of a JSON integer of hundreds of digits overflows.
        if isinstance(created_at, bool) or not isinstance(created_at, (int, float)) or not abs(created_at) < 1e12:
            raise CheckpointError("bad_manifest", f"{where}: created_at must be a finite number of seconds (a time)")
        total_bytes = field_of.integer(data["total_bytes"], "total_bytes", MAX_FILE_BYTES * MAX_MANIFEST_FILES)
        listed = sum(e.size for e in files.values())
        if total_bytes != listed:  # readers size the stage's room and progress by it
            raise CheckpointError(
                "bad_manifest", f"{where}: total_bytes is {total_bytes}, the files it lists add up to {listed}"
            )
        return cls(
            step=field_of.integer(data["step"], "step", MAX_STEP),
            weight_version=field_of.text(data["weight_version"], "weight_version"),
            created_at=float(created_at),
            writer=field_of.tree(data["writer"], "writer"),
            base_model=base_model,
            dtype=dtype,
            total_bytes=total_bytes,
            tensor_count=field_of.integer(data["tensor_count"], "tensor_count", 10**7),
            files=files,
            digest_algorithm=digest_algorithm,
            format_version=version,
            extra=field_of.tree(data.get("extra", {}), "extra"),
            run_id=run_id,
            kind=kind,
            delta=delta,
            adapter=adapter,
        )

    @classmethod
    def load(cls, checkpoint_dir: Path, *, root: Path | None = None) -> Manifest:
        """Read ``manifest.json`` of a checkpoint as untrusted input (see ``untrusted_files``)."""
        from .untrusted_files import read_small

        checkpoint_dir = Path(checkpoint_dir)
        path = checkpoint_dir / MANIFEST_NAME
        refuse_step_link(checkpoint_dir)
        try:
            raw = read_small(
                root if root is not None else checkpoint_dir.parent,
                path,
                where=f"{checkpoint_dir.name}/{MANIFEST_NAME}",
            )
        except CheckpointError as exc:
            if exc.reason == "missing_file":
                raise CheckpointError(
                    "missing_manifest",
                    f"{path} does not exist: {checkpoint_dir} is not a published checkpoint"
                    " (publish with `rollout-service publish` or trainer_hooks)",
                ) from None
            raise
        return cls.from_json(raw, where=str(path))


MAX_MANIFEST_FILES = 10_000
MAX_TREE_DEPTH, MAX_TREE_NODES, MAX_TREE_CHARS = 32, 10_000, 1 << 16
"""Nesting and size allowed in a manifest's free-form ``writer`` and ``extra`` objects: deeper
JSON parses but cannot be serialized again (Python's recursion limit), and a reader holds every
manifest of a delta chain (1000 links of 64 KiB of text each: 64 MB, not 1000 x 16 MiB)."""
MAX_BASE_MODEL_CHARS = 4096
"""The longest ``base_model`` (a hub id or a path: PATH_MAX is 4096), for the same reason."""
MAX_FILE_BYTES = 1 << 44
"""16 TiB: larger than any real shard, small enough that sizes cannot overflow sums."""
RUN_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}", re.ASCII)
_DIGEST_RE = re.compile(r"xxh3_128:[0-9a-f]{32}", re.ASCII)
_FINGERPRINT_RE = re.compile(r"[0-9a-f]{32}", re.ASCII)
MODULE_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}", re.ASCII)
"""A module name an adapter's ``adapter.target_modules`` may hold (what SGLang can target)."""
MAX_TARGET_MODULES = 64
"""The most module names an adapter's ``adapter.target_modules`` may hold."""


def parse_json_object(text: str | bytes, *, where: str, reason: str, unique_keys: bool = True) -> dict[str, Any]:
    """Parse untrusted JSON into a dict: strict UTF-8, no NaN/Infinity, bounded nesting (the json
    module's own recursion guard: deep nesting raises RecursionError, not a crash), and with
    ``unique_keys`` no key twice in one object (which of the two counts would depend on the
    reader: our manifests never repeat one; a model's ``config.json``, which transformers and
    SGLang read alike, is checked without it)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(reason, f"{where} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not a number JSON allows")

    def once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj = dict(pairs)
        if len(obj) != len(pairs):
            seen: set[str] = set()
            twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise ValueError(f"the key {twice[:80]!r} appears twice in one object")
        return obj

    try:
        data = json.loads(text, parse_constant=no_constants, object_pairs_hook=once if unique_keys else None)
    except RecursionError:
        raise CheckpointError(reason, f"{where} nests JSON too deeply to be a manifest") from None
    except ValueError as exc:
        raise CheckpointError(reason, f"{where} is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise CheckpointError(reason, f"{where} must hold a JSON object")
    return data


def _check_delta_files(delta: DeltaInfo, files: dict[str, FileEntry], where: str) -> None:
    """A delta lists the files its tensors name, the config and the index, and each shard of the
    full checkpoint holds a tensor (as the writer lays them out): so a chain's walk, which holds
    every link's manifest, holds no more file entries than tensor entries (``MAX_CHAIN_TENSORS``)."""
    named = {t.delta_file for t in delta.tensors.values() if t.delta_file is not None}
    unnamed = sorted(set(files) - named - {CONFIG_NAME, INDEX_NAME})
    if unnamed:
        raise CheckpointError(
            "bad_manifest", f"{where} lists {len(unnamed)} file(s) no tensor of the delta names: {unnamed[:3]}"
        )
    empty = sorted(set(delta.target_files) - {t.shard for t in delta.tensors.values()} - {CONFIG_NAME, INDEX_NAME})
    if empty:
        raise CheckpointError(
            "bad_manifest", f"{where}: delta.target_files lists {len(empty)} shard(s) holding no tensor: {empty[:3]}"
        )


class _FieldReader:
    """Type checks for manifest fields, each failure naming the field."""

    def __init__(self, where: str):
        self.where = where

    def _bad(self, name: str, want: str, value: Any) -> CheckpointError:
        shown = repr(value)
        return CheckpointError(
            "bad_manifest",
            f"{self.where}: {name} must be {want}, got {shown[:60] + ('...' if len(shown) > 60 else '')}",
        )

    def integer(self, value: Any, name: str, maximum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
            raise self._bad(name, f"an integer between 0 and {maximum}", value)
        return value

    def text(self, value: Any, name: str) -> str:
        if not isinstance(value, str) or len(value) > 256:
            raise self._bad(name, "a string of at most 256 characters", value)
        return value

    def obj(self, value: Any, name: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self._bad(name, "a JSON object", value)
        return value

    def digest(self, value: Any, name: str) -> str:
        if not isinstance(value, str) or not _DIGEST_RE.fullmatch(value):
            raise self._bad(name, f"'{DIGEST_ALGORITHM}:' and 32 hex digits", value)
        return value

    def file_name(self, value: Any, name: str) -> str:
        """A bare file name of the step directory (``path_escape`` otherwise): every name a
        manifest gives is joined to a directory by some reader, a stage copy or ``materialize``."""
        from .checkpoint_paths import check_plain_file_name

        if not isinstance(value, str):
            raise self._bad(name, "a file name", value)
        check_plain_file_name(value, where=f"{self.where}: {name}")
        return value

    def tree(self, value: Any, name: str) -> dict[str, Any]:
        """A free-form JSON object (``writer``, ``extra``): at most ``MAX_TREE_DEPTH`` levels and
        ``MAX_TREE_NODES`` values, finite numbers only, so that the manifest can be written back
        (fingerprints, stage copies)."""
        top = self.obj(value, name)
        todo: list[tuple[Any, int]] = [(top, 1)]
        nodes = chars = 0
        while todo:
            node, depth = todo.pop()
            nodes += 1
            if nodes > MAX_TREE_NODES:
                raise self._bad(name, f"JSON of at most {MAX_TREE_NODES} values", "...")
            if isinstance(node, (str, dict)):
                chars += len(node) if isinstance(node, str) else sum(len(k) for k in node)
                if chars > MAX_TREE_CHARS:
                    raise self._bad(name, f"JSON of at most {MAX_TREE_CHARS} characters of text", "...")
            if isinstance(node, float) and not math.isfinite(node):
                raise self._bad(name, "JSON with finite numbers only", node)
            if isinstance(node, (dict, list)):
                if depth > MAX_TREE_DEPTH:
                    raise self._bad(name, f"JSON nested at most {MAX_TREE_DEPTH} levels deep", "...")
                todo.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
        return top

    def files(self, raw: dict[str, Any], name: str) -> dict[str, FileEntry]:
        if len(raw) > MAX_MANIFEST_FILES:
            raise CheckpointError(
                "bad_manifest", f"{self.where} lists {len(raw)} {name}, more than the {MAX_MANIFEST_FILES} allowed"
            )
        files = {}
        for fname, e in raw.items():
            self.file_name(fname, name)
            at = f"{name}[{fname[:80]!r}]"
            e = self.obj(e, at)
            files[fname] = FileEntry(
                size=self.integer(e.get("size"), f"{at}.size", MAX_FILE_BYTES),
                digest=self.digest(e.get("digest"), f"{at}.digest"),
                tensors=self.integer(e.get("tensors", 0), f"{at}.tensors", 10**7),
            )
        return files

    def adapter(self, value: Any) -> AdapterInfo:
        a = self.obj(value, "adapter")
        unknown = sorted(set(a) - {"rank", "alpha", "target_modules", "peft_type", "base_values"})
        if unknown:
            raise self._bad("adapter", "rank, alpha, target_modules, peft_type and base_values only", unknown)
        if a.get("peft_type") != "LORA":
            raise self._bad("adapter.peft_type", "'LORA'", a.get("peft_type"))
        rank = self.integer(a.get("rank"), "adapter.rank", MAX_ADAPTER_RANK)
        if rank < 1:
            raise self._bad("adapter.rank", f"an integer between 1 and {MAX_ADAPTER_RANK}", rank)
        alpha = a.get("alpha")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1e6:
            raise self._bad("adapter.alpha", "a positive number below 1e6", alpha)
        modules = a.get("target_modules")
        if (
            not isinstance(modules, list)
            or not 0 < len(modules) <= MAX_TARGET_MODULES
            or not all(isinstance(m, str) and MODULE_NAME_RE.fullmatch(m) for m in modules)
        ):
            raise self._bad("adapter.target_modules", f"a list of 1-{MAX_TARGET_MODULES} module names", modules)
        base_values = None
        if "base_values" in a:
            raw = self.obj(a["base_values"], "adapter.base_values")
            if not 0 < len(raw) <= MAX_BASE_VALUES or not all(isinstance(k, str) and 0 < len(k) <= 256 for k in raw):
                raise self._bad("adapter.base_values", f"1-{MAX_BASE_VALUES} tensor names and their digests", raw)
            base_values = {k: self.base_tensor(v, f"adapter.base_values[{k[:80]!r}]") for k, v in raw.items()}
        return AdapterInfo(rank=rank, alpha=float(alpha), target_modules=list(modules), base_values=base_values)

    def base_tensor(self, value: Any, name: str) -> BaseTensor:
        e = self.obj(value, name)
        dtype = e.get("dtype")
        if set(e) != {"dtype", "digest"} or not isinstance(dtype, str) or dtype not in BASE_TENSOR_DTYPES:
            raise self._bad(name, f"{{'dtype': one of {sorted(BASE_TENSOR_DTYPES)}, 'digest': ...}}", e)
        return BaseTensor(dtype=dtype, digest=self.digest(e["digest"], f"{name}.digest"))

    def frames(self, value: Any, name: str, dtype: str, shape: list[int], frame_bytes: int) -> list[int]:
        """A changed tensor's frame sizes: one per ``frame_bytes`` of it, each at most what zstd
        can make of the bytes of *its* part (the last part may be short: a 2-byte tensor's frame
        cannot carry megabytes of padding that every replica reads), at least one non-zero."""
        size = DTYPE_SIZES[dtype] * math.prod(shape)
        count = -(-size // frame_bytes)
        if (
            not isinstance(value, list)
            or len(value) != count
            or not all(
                isinstance(x, int)
                and not isinstance(x, bool)
                and 0 <= x <= frame_bound(min(frame_bytes, size - i * frame_bytes))
                for i, x in enumerate(value)
            )
            or not any(value)
        ):
            raise self._bad(
                name,
                f"{count} frame sizes (one per {frame_bytes} bytes of the tensor, each at most what zstd makes of"
                " its part), not all 0",
                value,
            )
        return list(value)

    def delta(self, value: Any) -> DeltaInfo:
        d = self.obj(value, "delta")
        if d.get("codec") != DELTA_CODEC:
            raise CheckpointError(
                "bad_manifest",
                f"{self.where}: delta.codec is {str(d.get('codec'))[:40]!r}, this reader understands"
                f" {DELTA_CODEC!r} (a delta of another rollout-service version: run the same version"
                " on the trainer and the sidecars; the replica recovers at the next full step)",
            )
        frame_bytes = self.integer(d.get("frame_bytes"), "delta.frame_bytes", MAX_FRAME_BYTES)
        if frame_bytes < MIN_FRAME_BYTES or frame_bytes & (frame_bytes - 1):
            raise self._bad(
                "delta.frame_bytes",
                f"a power of two between {MIN_FRAME_BYTES} and {MAX_FRAME_BYTES} (whole elements of every dtype)",
                frame_bytes,
            )
        fp = d.get("base_fingerprint")
        if not isinstance(fp, str) or not _FINGERPRINT_RE.fullmatch(fp):
            raise self._bad("delta.base_fingerprint", "32 hex digits", fp)
        target = self.files(self.obj(d.get("target_files"), "delta.target_files"), "delta.target_files")
        raw_tensors = self.obj(d.get("tensors"), "delta.tensors")
        if len(raw_tensors) > 10**7:
            raise self._bad("delta.tensors", "at most 10**7 entries", len(raw_tensors))
        tensors = {}
        shard_of_file: dict[str, str] = {}
        """Each delta file's shard: a delta file holds the blobs of one shard's tensors (as the
        writer lays them out), so rebuilding a shard reads one file of that shard's size, never
        a file every shard shares (read and held whole once per shard)."""
        for tname, e in raw_tensors.items():
            at = f"delta.tensors[{tname[:80]!r}]"
            e = self.obj(e, at)
            shard = self.text(e.get("shard"), f"{at}.shard")
            if shard not in target:
                raise self._bad(f"{at}.shard", "one of delta.target_files", shard)
            dtype = e.get("dtype")
            if not (isinstance(dtype, str) and dtype in DTYPE_SIZES):
                raise self._bad(f"{at}.dtype", f"one of {sorted(DTYPE_SIZES)}", dtype)
            shape = e.get("shape")
            if (
                not isinstance(shape, list)
                or len(shape) > 8
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_FILE_BYTES for x in shape)
            ):
                raise self._bad(f"{at}.shape", "a list of at most 8 sizes", shape)
            delta_file = e.get("delta_file")
            frames = None
            if delta_file is not None:
                self.file_name(delta_file, f"{at}.delta_file")
                if shard_of_file.setdefault(delta_file, shard) != shard:
                    raise self._bad(
                        f"{at}.delta_file",
                        f"a delta file of its own shard's tensors ({delta_file[:80]!r} also holds"
                        f" {shard_of_file[delta_file][:80]!r}'s)",
                        delta_file,
                    )
                frames = self.frames(e.get("frames"), f"{at}.frames", dtype, shape, frame_bytes)
            tensors[tname] = DeltaTensor(
                shard=shard,
                dtype=dtype,
                shape=list(shape),
                digest=self.digest(e.get("digest"), f"{at}.digest"),
                delta_file=delta_file,
                frames=frames,
            )
        return DeltaInfo(
            base_step=self.integer(d.get("base_step"), "delta.base_step", MAX_STEP),
            base_fingerprint=fp,
            chain_start=self.integer(d.get("chain_start"), "delta.chain_start", MAX_STEP),
            target_files=target,
            tensors=tensors,
            codec=DELTA_CODEC,
            frame_bytes=frame_bytes,
            changed_tensors=self.integer(d.get("changed_tensors", 0), "delta.changed_tensors", 10**7),
            changed_bytes=self.integer(
                d.get("changed_bytes", 0), "delta.changed_bytes", MAX_FILE_BYTES * MAX_MANIFEST_FILES
            ),
        )
