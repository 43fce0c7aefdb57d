"""Telling the base model a LoRA adapter was trained on from another model of the same shapes.

An adapter changes a base model. Loaded on another base with the same tensor names and shapes (an
instruct fine-tune served in place of its base, or a merged fine-tune), it loads without an error
and SGLang generates from weights the trainer never had: the rollouts are off-policy and nothing
says so. So the trainer records in an adapter step's manifest (``adapter.base_values``) the
digests of a few of its base model's tensors, and the sidecar (before it loads the adapter) and
``rollout-service validate --reference`` compare them with the served model's own files
(``adapter_base_mismatch``).

A digest (:func:`values_digest`) covers the first :data:`SAMPLE_ELEMENTS` values of the
flattened tensor as the trainer holds them (the manifest records that dtype: a float16 trainer's
copy of bfloat16 files has lost what float16 cannot hold, so the reader casts the files' values
to float16 first), then rounded to bfloat16 (round to nearest even): a trainer holding float32
weights loaded from bfloat16 files agrees with those files, and a float32 model served as
published agrees with a trainer that rounded it to bfloat16.
:func:`pick_base_tensors` chooses which: the first and last adapted base weights and the first and
last one-dimensional weights (norms), by name; a fine-tune changes those where it changes anything.

Numpy only (the sidecar has no torch); the model folder is the operator's (links are followed,
as the HF cache needs), its headers read by :mod:`~rollout_service.safetensors_header`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from .checkpoint_format import INDEX_NAME, BaseTensor, CheckpointError, parse_json_object
from .digest import format_digest, new_hasher
from .safetensors_header import Entry, read_header
from .untrusted_files import MAX_SMALL_FILE_BYTES, open_regular, read_small

SAMPLE_ELEMENTS = 1 << 16
"""Values of each tensor a digest covers (the first ones of the flattened tensor): 128 KiB."""
PICKED = 4
"""Tensors :func:`pick_base_tensors` chooses."""

_READERS = {"BF16": "<u2", "F16": "<f2", "F32": "<f4", "F64": "<f8"}
"""The numpy dtype each floating safetensors dtype is read as (bfloat16 as its bits)."""
DIGESTIBLE_DTYPES = frozenset(_READERS)
"""The safetensors dtypes a base tensor's values digest can be taken of (:func:`values_digest`)."""


def values_digest(values: np.ndarray, held_as: str) -> str:
    """The digest of a base tensor's first :data:`SAMPLE_ELEMENTS` values (any floating numpy
    array, or bfloat16 bits as ``uint16``) as a trainer holding them in ``held_as`` (``F32``,
    ``F16``, ``BF16``, ``F64``) sees them: cast to that dtype (a float16 trainer loses what
    float16 cannot hold), then rounded to bfloat16."""
    flat = np.asarray(values).reshape(-1)[:SAMPLE_ELEMENTS]
    if flat.dtype == np.uint16:  # bfloat16 bits: exactly representable in float32
        flat = (flat.astype(np.uint32) << 16).view(np.float32)
    f32 = flat.astype(np.float32)
    if held_as == "F16":
        f32 = f32.astype(np.float16).astype(np.float32)
    wide = f32.view(np.uint32).astype(np.uint64)
    bits = ((wide + 0x7FFF + ((wide >> 16) & 1)) >> 16).astype("<u2")
    hasher = new_hasher()
    hasher.update(bits.tobytes())
    return format_digest(hasher)


def pick_base_tensors(shapes: Mapping[str, Sequence[int]], adapted: Iterable[str]) -> list[str]:
    """Up to :data:`PICKED` names of ``shapes`` (a base model's floating weights, by their
    checkpoint names) to record: the first and last of ``adapted`` (the weights the adapter
    changes) and the first and last one-dimensional weights."""
    chosen: list[str] = []
    for group in (sorted(n for n in adapted if n in shapes), sorted(n for n, s in shapes.items() if len(s) == 1)):
        for name in group[:1] + group[-1:]:
            if name not in chosen:
                chosen.append(name)
    return chosen[:PICKED]


def digests_in_model_dir(
    model_dir: Path, held_as: Mapping[str, str], *, files: Sequence[str] | None = None
) -> dict[str, str | None]:
    """The digest of each tensor named in ``held_as`` (name -> the dtype the trainer holds it in)
    as the safetensors files of ``model_dir`` hold it (None for a name no file holds, or of a
    dtype that is not floating). Raises ``CheckpointError`` for a file that cannot be read as
    safetensors, or an index that cannot be read.

    ``files``: the shards to read, by name, confined to ``model_dir`` (no link followed): a
    published step's, as its manifest lists them, since anything else in such a folder is
    untrusted. None: the folder is an operator's model (by its index, if any; links followed, as
    the HF cache needs)."""
    wanted = set(held_as)
    found: dict[str, str | None] = dict.fromkeys(wanted)
    if files is not None:
        shards = [(model_dir, model_dir / f) for f in sorted(files) if f.endswith(".safetensors") and "/" not in f]
    else:
        shards = [
            (Path(os.path.realpath(p)).parent, Path(os.path.realpath(p))) for p in _shards_holding(model_dir, wanted)
        ]
    for inside, path in shards:
        with open_regular(inside, path, where=str(path)) as (fd, st):
            entries = read_header(fd, st.st_size, str(path), foreign=files is None).by_name()
            for name in wanted & set(entries):
                values = _values_of_entry(fd, entries[name], f"{path}: {name}")
                found[name] = None if values is None else values_digest(values, held_as[name])
    return found


def _shards_holding(model_dir: Path, names: set[str]) -> list[Path]:
    """The files of ``model_dir`` that hold ``names``: by the index when there is one, else every
    ``*.safetensors`` file."""
    index = model_dir / INDEX_NAME
    if index.is_file():
        real = Path(os.path.realpath(index))
        raw = read_small(real.parent, real, where=str(index), max_bytes=MAX_SMALL_FILE_BYTES)
        data = parse_json_object(raw, where=str(index), reason="unreadable", unique_keys=False)
        weight_map = data.get("weight_map")
        if isinstance(weight_map, dict):
            files = {weight_map[n] for n in names if isinstance(weight_map.get(n), str)}
            return [model_dir / f for f in sorted(files) if "/" not in f]
    return sorted(model_dir.glob("*.safetensors"))


def _values_of_entry(fd: int, entry: Entry, where: str) -> np.ndarray | None:
    """The first values of a tensor (None for one not floating)."""
    reader = _READERS.get(entry.dtype)
    if reader is None:
        return None
    width = np.dtype(reader).itemsize
    count = min(entry.nbytes // width, SAMPLE_ELEMENTS)
    raw = os.pread(fd, count * width, entry.start)
    if len(raw) != count * width:
        raise CheckpointError("header_invalid", f"{where} was cut short while it was read")
    return np.frombuffer(raw, dtype=reader)


def check_base_values(
    expected: Mapping[str, BaseTensor], model_dir: Path, *, where: str, files: Sequence[str] | None = None
) -> str:
    """Compare an adapter's recorded ``expected`` base digests with ``model_dir``'s tensors.

    Returns a line saying what was compared; raises ``CheckpointError('adapter_base_mismatch')``
    when a tensor's values differ. A recorded name the folder does not hold is not compared (a
    model whose files name its tensors otherwise); the line then says nothing was. ``files``: as
    for :func:`digests_in_model_dir` (a published step's shards, by its manifest)."""
    found = digests_in_model_dir(model_dir, {n: t.dtype for n, t in expected.items()}, files=files)
    compared = [n for n in sorted(expected) if found.get(n) is not None]
    for name in compared:
        if found[name] != expected[name].digest:
            raise CheckpointError(
                "adapter_base_mismatch",
                f"{where} was trained on another base model than {model_dir}: the values of {name} differ"
                " (an instruct or fine-tuned variant of the same architecture?). Serve the model the"
                " trainer loads, or train from the one SGLang serves",
            )
    if not compared:
        return f"base model not compared: {model_dir} holds none of the recorded tensors {sorted(expected)[:4]}"
    return f"trained on this base model ({len(compared)} tensors' values compared)"
