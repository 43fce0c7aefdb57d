"""An HF model directory that ``rollout-service publish`` is pointed at, checked before anything
is written: input a user names and may get wrong.

:func:`check_model_dir` decides which files are the weights (the index's shards, else
``model.safetensors``; any other ``*.safetensors`` is refused by name), reads ``config.json``
and every shard header by the readers' own rules without blocking (a FIFO is refused), refuses a
folder that is a published delta or adapter step, tensors no checkpoint can hold, a tensor in two
shards, and a publication with more files than readers accept. :func:`publish_model_dir`
publishes what it checked through :func:`~rollout_service.checkpoint_writer.publish_checkpoint`,
reading the bytes with ``pread`` (a file cut short names itself instead of crashing a mapping).
Every refusal is a :class:`~rollout_service.checkpoint_writer.PublishRefused` naming the file,
the tensor and what to do.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch

from .checkpoint_format import (
    CONFIG_NAME,
    DTYPE_SIZES,
    FLOAT_DTYPES,
    INDEX_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_FILES,
    CheckpointError,
    normalize_dtype,
    parse_json_object,
    parse_step_dir_name,
    step_dir_name,
)
from .checkpoint_paths import check_plain_file_name
from .checkpoint_reader import MAX_CHECKPOINT_ENTRIES, _specs_of_fd
from .checkpoint_writer import (
    _TAG_TO_TORCH,
    DEFAULT_MAX_SHARD_BYTES,
    PublishRefused,
    PublishResult,
    ShardPlanner,
    _shown,
    check_tensor_name,
    index_json,
    publish_checkpoint,
    shard_file_names,
)
from .safetensors_header import read_header
from .untrusted_files import MAX_SMALL_FILE_BYTES, _kind, open_regular, read_small

log = logging.getLogger(__name__)

_STORABLE_TAGS = sorted(_TAG_TO_TORCH)
"""The dtypes a checkpoint written here can hold (the model folder's tensors must be among them)."""


@dataclass(frozen=True)
class _SourceTensor:
    """One tensor of a model folder's shard, as its header describes it."""

    name: str
    tag: str
    shape: tuple[int, ...]
    start: int
    """Where its bytes start and end in the file (absolute offsets)."""
    end: int


@dataclass(frozen=True)
class _SourceShard:
    name: str
    """Its file name in the model folder."""
    path: Path
    tensors: tuple[_SourceTensor, ...]
    """By name (the order they are published in)."""


@dataclass(frozen=True)
class ModelDirSource:
    """A model folder that :func:`check_model_dir` found publishable: its ``config.json`` bytes
    (as read and checked) and the shards to publish with their tensors, in publishing order."""

    path: Path
    config: bytes
    shards: tuple[_SourceShard, ...]

    @property
    def tensor_count(self) -> int:
        return sum(len(s.tensors) for s in self.shards)


def _refused(message: str, rule: str, tensor: str = "") -> PublishRefused:
    return PublishRefused(f"{message}. Nothing was published", tensor=tensor, rule=rule)


def _open_source(path: Path) -> contextlib.AbstractContextManager[tuple[int, os.stat_result]]:
    """``path`` (a file of the model folder) opened as :func:`open_regular` opens checkpoint files:
    never blocking (a FIFO or device is refused after ``fstat``), a regular file only. A link is
    followed wherever it leads (a hub cache snapshot links every file into ``../../blobs``)."""
    real = Path(os.path.realpath(path))
    return open_regular(real.parent, real, where=str(path))


def _read_source_small(path: Path, rule: str, advice: str) -> bytes:
    """A small file of the model folder (config, index, manifest), capped as readers cap it."""
    real = Path(os.path.realpath(path))
    try:
        return read_small(real.parent, real, where=str(path))
    except CheckpointError as exc:
        raise _refused(f"{exc}; {advice}", rule) from None


def _refuse_other_kinds(model_dir: Path) -> None:
    """Refuse a published delta or adapter step's folder (its ``manifest.json`` says so).

    Only the ``kind`` is read (leniently: a manifest this version cannot fully parse, a delta of
    another codec, is still a delta). A ``manifest.json`` that is unreadable or not JSON is not
    ours to judge (a full step's folder is published as a model folder; the manifest is never
    copied): it is logged and the folder is checked as any other. A damaged delta step is still
    refused then, for it holds no ``model.safetensors`` nor index (see :func:`check_model_dir`).
    """
    path = model_dir / MANIFEST_NAME
    if not os.path.lexists(path):
        return
    real = Path(os.path.realpath(path))
    try:
        data = parse_json_object(read_small(real.parent, real, where=str(path)), where=str(path), reason="bad_manifest")
    except CheckpointError as exc:
        log.warning("%s: not a checkpoint manifest (%s); publishing the folder as a model folder", path, exc)
        return
    kind = data.get("kind", "full")
    if kind == "full":
        return
    if kind == "delta":
        step = data.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            step = parse_step_dir_name(model_dir.name)
        raise _refused(
            f"{model_dir} is a delta step (its {MANIFEST_NAME} says kind 'delta'): its .safetensors files hold"
            " compressed differences from the step before, not weights, and every reader would reject them"
            " as a model. Rebuild it as a model folder first: `rollout-service materialize"
            f" {model_dir.parent} --step {'N' if step is None else step} --out DIR`, then publish DIR",
            "not_a_full_model",
        )
    if kind == "adapter":
        raise _refused(
            f"{model_dir} is an adapter step (its {MANIFEST_NAME} says kind 'adapter'): a LoRA adapter, not a"
            " full model. An adapter is published with publish_adapter (rollout_service.adapter_writer, as"
            " the trainer's LoRA publisher does); to publish full weights, merge the adapter into its base"
            " model (PEFT's merge_and_unload), save_pretrained it and publish that folder",
            "not_a_full_model",
        )
    raise _refused(
        f"{model_dir}: its {MANIFEST_NAME} says kind {str(kind)[:40]!r}, not 'full': only a full model folder"
        " can be published (a step of a newer rollout-service? materialize it with that version)",
        "not_a_full_model",
    )


def _listed_names(names: list[str], model_dir: Path) -> str:
    """``a.safetensors (a FIFO), b.safetensors``: names, each with what it is unless a regular file."""
    shown = []
    for name in names[:5]:
        try:
            mode = os.stat(model_dir / name).st_mode  # follows links; never blocks, even on a FIFO
            shown.append(name if stat.S_ISREG(mode) else f"{name} ({_kind(mode)})")
        except OSError:
            shown.append(f"{name} (a broken link)")
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return ", ".join(shown) + more


def _index_shards(model_dir: Path) -> tuple[dict[str, str], list[str]]:
    """The index's weight map and the shards it lists, each a file of the folder by name."""
    path = model_dir / INDEX_NAME
    advice = f"fix or re-download {INDEX_NAME} (the tensor -> shard map of a sharded model)"
    raw = _read_source_small(path, "bad_index", advice)
    try:
        data = parse_json_object(raw, where=str(path), reason="bad_index")
    except CheckpointError as exc:
        raise _refused(f"{exc}; {advice}", "bad_index") from None
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise _refused(
            f"{path}: weight_map must be a non-empty object of tensor name -> shard file; {advice}", "bad_index"
        )
    for tname, fname in weight_map.items():
        if not isinstance(fname, str):
            raise _refused(
                f"{path}: weight_map gives tensor {_shown(tname)} the shard {fname!r}; {advice}", "bad_index"
            )
    shards = sorted(set(weight_map.values()))
    for fname in shards:
        try:
            check_plain_file_name(fname, where=str(path))
        except CheckpointError:
            raise _refused(
                f"{path} lists the shard {fname!r}, which is not a file name of {model_dir} (only bare names:"
                f" no folders, '..' or absolute paths; what is published must be the folder's own); {advice}",
                "bad_index",
            ) from None
        if not fname.endswith(".safetensors"):
            raise _refused(f"{path} lists the shard {fname!r}, which is not a .safetensors file; {advice}", "bad_index")
        if not os.path.lexists(model_dir / fname):
            raise _refused(
                f"{path} lists the shard {fname!r}, which {model_dir} does not hold: the model folder is"
                " incomplete (an interrupted download or copy): fetch it again",
                "bad_index",
            )
    return weight_map, shards


def _shard_tensors(fd: int, path: Path) -> tuple[_SourceTensor, ...]:
    """The tensors of the safetensors file open at ``fd``, by name, with where their bytes are.

    The header is checked by the reader's own parser (safetensors', on a private copy of the
    header: see ``checkpoint_reader``), so what it accepts here it accepts once published; each
    tensor's name and dtype must be ones a checkpoint can hold.
    """
    where = str(path)
    try:
        specs = _specs_of_fd(fd, where)
    except CheckpointError as exc:
        raise _refused(
            f"{exc} (truncated, or not a safetensors file); re-save the model (save_pretrained) or download it again",
            "bad_shard",
        ) from None
    for name, (tag, _) in specs.items():
        try:
            check_tensor_name(name)
        except PublishRefused as exc:
            raise PublishRefused(f"{where}: {exc}", tensor=exc.tensor, rule=exc.rule) from None
        if tag not in _TAG_TO_TORCH:
            raise _refused(
                f"{where}: tensor {_shown(name)} has dtype {tag}, which a checkpoint cannot hold (it holds"
                f" {', '.join(_STORABLE_TAGS)}); convert the tensor (an unsigned index to I32 or I64) and"
                " re-save the model, or remove it",
                "dtype",
                name,
            )
    # Where each tensor's bytes are (the header safetensors just accepted, read again from the file).
    try:  # foreign: as safetensors just read it (a key given twice: the last counts)
        found = read_header(fd, os.fstat(fd).st_size, where, foreign=True).by_name()
    except CheckpointError as exc:
        raise _refused(
            f"{exc} (truncated, or changed while it was read); re-save the model (save_pretrained) or download"
            " it again",
            "bad_shard",
        ) from None
    except OSError as exc:
        raise _refused(f"{where}: reading its header failed: {exc.strerror}", "bad_shard") from None
    tensors = []
    for name in sorted(specs):
        tag, shape = specs[name]
        entry = found.get(name)
        if entry is None or (entry.dtype, entry.shape) != (tag, tuple(shape)):
            raise _refused(
                f"{where} changed while it was read (its header no longer says what it said for tensor"
                f" {_shown(name)}): publish again once nothing writes to the model folder",
                "bad_shard",
                name,
            )
        tensors.append(_SourceTensor(name, tag, tuple(shape), entry.start, entry.end))
    return tuple(tensors)


def check_model_dir(
    model_dir: Path | str, *, dtype: str | None = None, max_shard_bytes: int | None = None
) -> ModelDirSource:
    """Check an HF model folder before anything is published from it; return what to publish.

    The folder is input a user points at, and may be wrong: every problem is a
    :class:`PublishRefused` (a ``ValueError``) naming the file (and tensor) and what to do, raised
    before a work folder exists (a folder without ``config.json`` or weights at all is a
    ``FileNotFoundError``, as before). ``rule`` says which check:

    - ``model_dir``: the path is not a directory.
    - ``not_a_full_model``: a published delta or adapter step's folder (its ``manifest.json``
      says so): a delta holds compressed differences (``materialize`` rebuilds the model), an
      adapter is no full model.
    - ``bad_config``: ``config.json`` is not a regular file of at most readers' cap, or not a
      JSON object (the reader's own parse: every reader would reject the step as ``bad_config``).
    - ``bad_index``/``stray_file``: which files are the weights. With
      ``model.safetensors.index.json``, exactly the shards its ``weight_map`` lists, each a bare
      file name of the folder (no folder, ``..`` or absolute path), present, and the map must say
      where each tensor is. Without an index, ``model.safetensors`` alone. Any other
      ``*.safetensors`` in the folder (a ``consolidated.safetensors``, a stale single file beside
      shards, a FIFO or a folder named like a shard) is refused by name rather than ignored with
      a warning: which weights are the model's is then ambiguous, and a refusal costs one ``mv``
      while a wrong guess publishes a step every replica loads. Hidden files (``.name``) are
      ignored, as the loaders' globs ignore them.
    - ``bad_shard``/``dtype``/``tensor_name``/``duplicate``: a shard that is not a regular file
      (opened without blocking: a FIFO is refused, never waited on), whose header the reader's
      parser rejects (garbage, truncated, oversized), with a dtype a checkpoint cannot hold
      (``U16``/``U32``/``U64``), a name readers cannot parse, or a tensor in two shards (both named).
      Integer tensors of storable dtypes are published: the sidecar accepts them when the served
      model has them too (its reference), as SGLang loads them.
    - ``too_many_files`` (only with ``max_shard_bytes``, the shard size to publish with, and
      ``dtype``, the conversion): the step would hold more files than readers accept
      (``MAX_MANIFEST_FILES`` listed, ``MAX_CHECKPOINT_ENTRIES`` in its folder) or an index larger
      than they read (``MAX_SMALL_FILE_BYTES``).

    Links are followed to the regular file they lead to (a hub cache snapshot links every file
    into ``../../blobs``): confinement is by name (the index may only name the folder's files);
    what the folder's own entries link to is the folder owner's choice.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise _refused(
            f"{model_dir} is not a directory: pass an HF model folder (config.json and safetensors)", "model_dir"
        )
    _refuse_other_kinds(model_dir)
    config_path = model_dir / CONFIG_NAME
    if not os.path.lexists(config_path):
        raise FileNotFoundError(f"{model_dir} has no {CONFIG_NAME}; pass an HF model directory")
    advice = f"every reader would reject the step as bad_config: fix or replace {CONFIG_NAME} (the model's JSON config)"
    config = _read_source_small(config_path, "bad_config", advice)
    try:
        parse_json_object(config, where=str(config_path), reason="bad_config", unique_keys=False)
    except CheckpointError as exc:
        raise _refused(f"{exc}; {advice}", "bad_config") from None

    with os.scandir(model_dir) as listing:
        found = sorted(e.name for e in listing if e.name.endswith(".safetensors") and not e.name.startswith("."))
    weight_map: dict[str, str] | None = None
    if os.path.lexists(model_dir / INDEX_NAME):
        weight_map, names = _index_shards(model_dir)
        stray = sorted(set(found) - set(names))
        if stray:
            raise _refused(
                f"{model_dir}: {INDEX_NAME} does not list: {_listed_names(stray, model_dir)}; which files hold"
                " the model is ambiguous (a stale copy, the same weights in another format): move them out of"
                " the folder, or fix the index",
                "stray_file",
            )
    elif found == ["model.safetensors"]:
        names = found
    elif not found:
        raise FileNotFoundError(f"{model_dir} holds no model.safetensors (nor {INDEX_NAME} and its shards) to publish")
    else:
        raise _refused(
            f"{model_dir} has no {INDEX_NAME}, so its weights must be one file, model.safetensors, but it holds:"
            f" {_listed_names(found, model_dir)}; which files hold the model is ambiguous: move the others out of"
            " the folder (or add the index of a sharded model)",
            "stray_file",
        )

    shards = []
    owner: dict[str, str] = {}
    for name in names:
        path = model_dir / name
        try:
            with _open_source(path) as (fd, _):
                tensors = _shard_tensors(fd, path)
        except CheckpointError as exc:
            raise _refused(f"{exc}; publish a folder of regular safetensors files", "bad_shard") from None
        for t in tensors:
            if t.name in owner:
                raise _refused(
                    f"tensor {_shown(t.name)} is in both {owner[t.name]} and {name} in {model_dir}: one is a"
                    " stale or partial copy; remove it (or fix the index)",
                    "duplicate",
                    t.name,
                )
            owner[t.name] = name
        shards.append(_SourceShard(name, path, tensors))
    if not owner:
        raise _refused(f"{model_dir}: {', '.join(names)} hold no tensors", "bad_shard")
    if weight_map is not None and weight_map != owner:
        _raise_index_mismatch(model_dir / INDEX_NAME, weight_map, owner)
    source = ModelDirSource(path=model_dir, config=config, shards=tuple(shards))
    if max_shard_bytes is not None:
        _check_file_counts(source, normalize_dtype(dtype), max_shard_bytes)
    return source


def _raise_index_mismatch(path: Path, weight_map: dict[str, str], owner: dict[str, str]) -> NoReturn:
    for tname, fname in sorted(weight_map.items()):
        if owner.get(tname) != fname:
            held = f"it is in {owner[tname]}" if tname in owner else "no shard it lists holds it"
            raise _refused(
                f"{path} says tensor {_shown(tname)} is in {fname}, but {held}: the index does not belong to these"
                " shards (a mixed or partial download); fetch the model again",
                "bad_index",
                tname,
            )
    tname = min(set(owner) - set(weight_map))
    raise _refused(
        f"{path} does not list tensor {_shown(tname)} of {owner[tname]}: the index does not belong to these shards"
        " (a mixed or partial download); fetch the model again",
        "bad_index",
        tname,
    )


def _check_file_counts(source: ModelDirSource, target: str | None, max_shard_bytes: int) -> None:
    """Refuse a step readers would reject for its size: more files than the manifest may list or
    its folder may hold, or an index larger than readers read. The shards are planned exactly as
    :func:`publish_checkpoint` cuts them (:class:`ShardPlanner`, sizes after the ``target`` cast)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    planner = ShardPlanner(max_shard_bytes)
    shard_of: dict[str, int] = {}
    total = largest = 0
    for shard in source.shards:
        for t in shard.tensors:
            tag = target if target is not None and t.tag in FLOAT_DTYPES else t.tag
            nbytes = DTYPE_SIZES[tag] * math.prod(t.shape)
            planner.starts_new_shard(nbytes)
            shard_of[t.name] = planner.count
            total, largest = total + nbytes, max(largest, nbytes)
    count = planner.count
    files = count + (1 if count > 1 else 0) + 1  # shards, index, config.json
    if files > MAX_MANIFEST_FILES or files + 1 > MAX_CHECKPOINT_ENTRIES:
        # Next-fit packing: any two neighbouring shards hold more than the limit, so this bounds the count.
        enough = max(largest, 2 * total // max(1, MAX_CHECKPOINT_ENTRIES - 4) + 1)
        raise _refused(
            f"{source.path}: {source.tensor_count} tensors in shards of at most {max_shard_bytes} bytes make a step"
            f" of {count} shards, {files} files with the index and config.json, and its {MANIFEST_NAME}: more"
            f" than readers accept ({MAX_MANIFEST_FILES} files in a manifest, {MAX_CHECKPOINT_ENTRIES} entries"
            f" in a step folder), so every reader would reject it; publish with larger shards"
            f" (--max-shard-mb {math.ceil(enough / (1 << 20) * 1000) / 1000:g} or more)",
            "too_many_files",
        )
    if count > 1:
        names = shard_file_names(count)
        index = index_json({k: names[i - 1] for k, i in shard_of.items()}, total).encode()
        if len(index) > MAX_SMALL_FILE_BYTES:
            raise _refused(
                f"{source.path}: its {source.tensor_count} tensors make a {INDEX_NAME} of {len(index)} bytes, more"
                f" than the {MAX_SMALL_FILE_BYTES} readers read, so every reader would reject the step; publish it"
                " as one shard (a --max-shard-mb above the model's size) or with shorter tensor names",
                "too_many_files",
            )


def iter_model_dir_tensors(model_dir: Path | str | ModelDirSource) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the tensors of an HF model folder's shards, one at a time (shards and tensors by name).

    A path is first checked as :func:`check_model_dir` does (now, not at the first ``next``).
    Each shard is opened again without blocking and its header must still say what it said when
    checked; bytes are read with ``pread`` (never mapped: a file truncated meanwhile is an error
    naming it, not a SIGBUS).
    """
    source = model_dir if isinstance(model_dir, ModelDirSource) else check_model_dir(model_dir)
    return _stream_source(source)


def _stream_source(source: ModelDirSource) -> Iterator[tuple[str, torch.Tensor]]:
    for shard in source.shards:
        with contextlib.ExitStack() as stack:
            try:
                fd, _ = stack.enter_context(_open_source(shard.path))
            except CheckpointError as exc:
                raise _refused(f"{exc}; publish again once nothing changes the model folder", "bad_shard") from None
            if _shard_tensors(fd, shard.path) != shard.tensors:
                raise _refused(
                    f"{shard.path} changed while the model folder was published: publish again once nothing"
                    " writes to it",
                    "bad_shard",
                )
            for t in shard.tensors:
                yield t.name, _read_tensor(fd, shard.path, t)


def _read_tensor(fd: int, path: Path, t: _SourceTensor) -> torch.Tensor:
    """A tensor's bytes read with ``pread`` into a tensor of its own (never a mapped file)."""
    buf = torch.empty(t.end - t.start, dtype=torch.uint8)
    if _pread_into(fd, path, memoryview(buf.numpy()), t.start, t.name) < len(buf):
        raise _refused(
            f"{path} ends inside tensor {_shown(t.name)}: it was truncated while it was published; publish"
            " again once nothing writes to the model folder",
            "bad_shard",
            t.name,
        )
    return buf.view(_TAG_TO_TORCH[t.tag]).reshape(t.shape)


def _pread_into(fd: int, path: Path, view: memoryview, offset: int, tensor: str) -> int:
    """Fill ``view`` from ``offset`` until it is full or the file ends; how many bytes were read."""
    got = 0
    while got < len(view):
        try:
            n = os.preadv(fd, [view[got:]], offset + got)
        except OSError as exc:
            what = f" (tensor {_shown(tensor)})" if tensor else ""
            raise _refused(
                f"{path}: reading at byte {offset + got}{what} failed: {exc.strerror}", "bad_shard", tensor
            ) from None
        if not n:
            break
        got += n
    return got


def publish_model_dir(
    model_dir: Path | str,
    root: Path | str,
    step: int,
    *,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> PublishResult:
    """Publish an existing HF model directory as ``step`` (seeding, rollback, tests).

    The folder is checked first (:func:`check_model_dir`, with this ``dtype`` and shard size):
    whatever is wrong with it is refused before the work folder is made, naming the file (and
    tensor) and what to do. ``config.json`` is published as read and checked then.

    The published step is not validated again by the reader before its rename: what readers
    check of it is either checked above on the input with the readers' own parsers and limits
    (config, headers, dtypes, file counts) or written by this module's writer (names, headers,
    digests, manifest, NaN/Inf); a second pass would only re-read what was just written.
    """
    target = normalize_dtype(dtype)
    step_dir_name(step)  # a bad step number before the folder is read
    source = check_model_dir(model_dir, dtype=target, max_shard_bytes=max_shard_bytes)
    return publish_checkpoint(
        root,
        step,
        iter_model_dir_tensors(source),
        config=source.config,
        dtype=target,
        max_shard_bytes=max_shard_bytes,
        base_model=str(source.path.resolve()),
    )
