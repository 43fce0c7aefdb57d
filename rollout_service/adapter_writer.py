"""Atomic publication of a PEFT LoRA adapter as an ``adapter`` checkpoint step.

``publish_adapter`` writes what PEFT's ``save_pretrained`` writes (``adapter_model.safetensors``
with names like ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, and
``adapter_config.json``, its ``target_modules`` the modules those tensors change) plus the
manifest, through the same hidden work folder, fsyncs and single rename as a full checkpoint
(:func:`~rollout_service.checkpoint_writer.atomic_step_dir`), so readers see an adapter step
completely or not at all. An adapter every reader would reject (NaN/Inf weights, a tensor name
no reader parses, a weight of a dtype outside ``ADAPTER_DTYPES``, a manifest or config readers
refuse: :func:`adapter_step_problem`) is refused
with :class:`~rollout_service.checkpoint_writer.PublishRefused` before anything of it is written.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .adapter_reader import ADAPTER_DTYPES, check_config_matches, target_module_problem
from .checkpoint_format import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    MAX_ADAPTER_HEADER_BYTES,
    MAX_BASE_VALUES,
    AdapterInfo,
    BaseTensor,
    CheckpointError,
    Manifest,
    normalize_dtype,
    parse_json_object,
    step_dir_name,
)
from .checkpoint_reader import TensorSpecs
from .checkpoint_writer import (
    _TORCH_TO_TAG,
    FINITE_CHUNK_BYTES,
    PublishRefused,
    PublishResult,
    _byte_view,
    _shown,
    _write_shard,
    atomic_step_dir,
    check_run_id,
    check_tensor_names,
    count_non_finite_bytes,
    new_manifest,
    non_finite_refusal,
    shard_prefix,
    write_manifest,
    write_small,
)

log = logging.getLogger(__name__)

LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_TAGS = {dtype: tag for dtype, tag in _TORCH_TO_TAG.items() if tag in ADAPTER_DTYPES}
"""The dtypes adapters are published in: ``ADAPTER_DTYPES``, the ones readers accept."""
_TORCH_OF = {tag: dtype for dtype, tag in _TAGS.items()}


def lora_target_modules(names: list[str]) -> list[str]:
    """The module names (``q_proj``, ...) that adapter tensor names change, sorted."""
    found = set()
    for name in names:
        for suffix in LORA_SUFFIXES:
            if name.endswith(suffix):
                found.add(name[: -len(suffix)].rsplit(".", 1)[-1])
    return sorted(found)


def adapter_info(tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> AdapterInfo:
    """Rank, alpha and target modules of an adapter (modules from the tensors themselves)."""
    modules = lora_target_modules(list(tensors))
    if not modules:
        raise ValueError("no LoRA tensors (names ending in .lora_A.weight / .lora_B.weight) to publish")
    return AdapterInfo(
        rank=int(config["r"]),
        alpha=float(config["lora_alpha"]),
        target_modules=modules,
        peft_type=str(getattr(config.get("peft_type"), "value", config.get("peft_type") or "LORA")),
    )


def published_config(config: Mapping[str, Any], target_modules: list[str]) -> dict[str, Any]:
    """The adapter config as published: PEFT's, with ``target_modules`` the modules the tensors
    change (:func:`adapter_info`), as the manifest says. PEFT's own list may name modules the
    model lacks or a pattern; readers require the config and the manifest to agree."""
    return {**config, "target_modules": list(target_modules)}


def adapter_step_problem(
    info: AdapterInfo,
    config: Mapping[str, Any],
    *,
    step: int = 1,
    tensor_count: int = 1,
    base_model: str | None = None,
    dtype: str | None = None,
    run_id: str | None = None,
) -> tuple[str, str] | None:
    """(rule, why) when readers would refuse the adapter step describing ``info`` with the
    published ``config`` (:func:`published_config`); None when they would not.

    Checked the way readers check it: the manifest :func:`publish_adapter` would write (the files
    aside, which the writer makes itself) parsed by :meth:`Manifest.from_json`, and
    ``adapter_config.json`` as written compared with it as the sidecar does
    (:func:`~rollout_service.adapter_reader.check_config_matches`). What PEFT
    allows and readers refuse (a ``lora_alpha`` of 0 or from 1e6, a rank past
    ``MAX_ADAPTER_RANK``, a module inside an ``nn.Sequential``, whose name is its index) would
    otherwise be a visible step every replica rejects. Rules: ``target_modules`` (see
    :func:`~rollout_service.adapter_reader.target_module_problem`), ``adapter_manifest`` and
    ``adapter_config``. The trainer asks this at start-up, to sync merged instead."""
    problem = target_module_problem(info.target_modules)
    if problem is not None:
        return "target_modules", problem
    probe = new_manifest(
        step,
        {},
        tensor_count=tensor_count,
        kind="adapter",
        adapter=info,
        base_model=base_model,
        dtype=dtype,
        run_id=run_id,
    )
    try:
        Manifest.from_json(probe.to_json(), where="its manifest")
    except CheckpointError as exc:
        return "adapter_manifest", str(exc)
    try:
        text = adapter_config_json(config)
    except (TypeError, ValueError) as exc:  # an object PEFT never puts in its config
        return "adapter_config", f"{ADAPTER_CONFIG_NAME} cannot be written as JSON: {exc}"
    try:
        written = parse_json_object(text, where=ADAPTER_CONFIG_NAME, reason="bad_adapter_config")
        check_config_matches(written, info, where=ADAPTER_CONFIG_NAME)
    except CheckpointError as exc:
        return "adapter_config", str(exc)
    return None


def adapter_specs(tensors: Mapping[str, torch.Tensor], dtype: str | None = None) -> TensorSpecs:
    """Name -> (dtype tag, shape) of the tensors :func:`publish_adapter` would write with ``dtype``
    (a cast applies to floating tensors only): what readers check, without writing anything."""
    want = _TORCH_OF.get(normalize_dtype(dtype) or "")
    specs: TensorSpecs = {}
    for name, t in tensors.items():
        written = _written_dtype(t, want)
        specs[name] = (_TORCH_TO_TAG.get(written, str(written).removeprefix("torch.")), tuple(t.shape))
    return specs


def _written_dtype(t: torch.Tensor, want: torch.dtype | None) -> torch.dtype:
    """The dtype ``t`` is written in: ``want`` for a floating tensor, when given."""
    return want if want is not None and t.is_floating_point() else t.dtype


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return (
            sorted(_jsonable(v) for v in value)
            if isinstance(value, (set, frozenset))
            else [_jsonable(v) for v in value]
        )
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):  # PeftType, TaskType (str enums)
        return value.value
    return value


def adapter_config_json(config: Mapping[str, Any]) -> str:
    """``adapter_config.json`` as PEFT reads it (sets and enums made JSON)."""
    return json.dumps(_jsonable(dict(config)), indent=2, sort_keys=True) + "\n"


def _dtype_refusal(name: str, dtype: torch.dtype, cast: str | None) -> PublishRefused:
    """The error for an adapter weight that is not float32, float16 or bfloat16 (as it would be written)."""
    hint = (
        "pass dtype='bfloat16' (or float32, float16) to cast it"
        if dtype.is_floating_point and cast is None
        else "LoRA weights are floating point (dtype= casts floating tensors only)"
    )
    return PublishRefused(
        f"tensor {_shown(name)} is {str(dtype).removeprefix('torch.')}: adapters are published as float32,"
        f" float16 or bfloat16 tensors (every replica would reject it as dtype_unloadable); {hint}."
        " Nothing was published",
        tensor=name,
        rule="dtype",
    )


def _refuse_non_finite(prepared: list[tuple[str, torch.Tensor]]) -> None:
    """:class:`PublishRefused` for the first tensor (in file order) holding NaN/Inf as written."""
    scratch = np.empty(FINITE_CHUNK_BYTES, dtype=np.uint8)
    for name, t in prepared:
        tag = _TAGS[t.dtype]
        count = count_non_finite_bytes(_byte_view(t), tag, scratch)
        if count:
            raise non_finite_refusal(name, tag, t.numel(), count)


def _refuse_large_header(prepared: list[tuple[str, torch.Tensor]]) -> None:
    """:class:`PublishRefused` for an adapter whose header readers refuse (``MAX_ADAPTER_HEADER_BYTES``)."""
    prefix, _ = shard_prefix((n, _TAGS[t.dtype], tuple(t.shape)) for n, t in prepared)
    if len(prefix) - 8 > MAX_ADAPTER_HEADER_BYTES:
        raise PublishRefused(
            f"the adapter's safetensors header would be {len(prefix) - 8} bytes ({len(prepared)} tensors), over"
            f" the {MAX_ADAPTER_HEADER_BYTES} readers accept: adapt fewer modules or layers. Nothing was published",
            tensor="",
            rule="header_too_large",
        )


def publish_adapter(
    root: Path | str,
    step: int,
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    *,
    dtype: str | None = None,
    base_model: str | None = None,
    run_id: str | None = None,
    check_finite: bool = True,
    base_values: Mapping[str, BaseTensor] | None = None,
) -> PublishResult:
    """Publish a LoRA adapter as ``<root>/step-<step>`` (kind ``adapter``) atomically.

    ``tensors`` are PEFT's saved names (``get_peft_model_state_dict``), ``config`` the adapter's
    ``LoraConfig.to_dict()``; ``dtype`` casts floating tensors (adapters are float32, float16 or
    bfloat16: another ``dtype`` is a ``ValueError``). Raises ``FileExistsError`` if the step is
    already published, ``ValueError`` when there are no LoRA tensors.

    As :func:`~rollout_service.checkpoint_writer.publish_checkpoint` does, an adapter every reader
    would reject is refused with :class:`~rollout_service.checkpoint_writer.PublishRefused` (a
    ``ValueError``) and nothing of the step becomes visible: a tensor name readers cannot parse
    (:func:`~rollout_service.checkpoint_writer.check_tensor_name`, rule ``tensor_name``), a tensor
    that is not float32/float16/bfloat16 as written (rule ``dtype``), and with ``check_finite``
    (the default; False only to make adapters that readers must reject, in tests) a tensor holding
    NaN/Inf as written, after the cast (rule ``non_finite``), a manifest or config readers refuse
    (:func:`adapter_step_problem`: rules ``target_modules``, ``adapter_manifest``,
    ``adapter_config``): all before the work folder is made.
    A header larger than readers accept (``header_too_large``) is refused as the work folder's
    file is written, and the folder removed. ``base_values`` (a few of the base model's tensors:
    their dtype in the trainer and the digest of their values, :mod:`~rollout_service.base_values`)
    go into the manifest, so that readers can
    tell the base the adapter was trained on.
    """
    t0 = time.perf_counter()
    target = normalize_dtype(dtype)
    if target is not None and target not in _TORCH_OF:
        raise ValueError(f"adapter dtype {dtype!r}: adapters are published as float32, float16 or bfloat16")
    run_id = check_run_id(run_id)
    check_tensor_names(tensors)  # before the names are used (a non-string key), before any folder
    info = adapter_info(tensors, config)
    if base_values:
        if len(base_values) > MAX_BASE_VALUES:
            raise ValueError(f"at most {MAX_BASE_VALUES} base_values, got {len(base_values)}")
        info.base_values = dict(base_values)
    want = _TORCH_OF.get(target or "")
    prepared = []
    for name in sorted(tensors):
        t = tensors[name].detach()
        t = t.to(_written_dtype(t, want))
        if t.dtype not in _TAGS:
            raise _dtype_refusal(name, t.dtype, target)
        prepared.append((name, t.to("cpu").contiguous()))
    if check_finite:
        _refuse_non_finite(prepared)  # an adapter is small: one pass before anything is made
    _refuse_large_header(prepared)
    tags = {_TAGS[t.dtype] for _, t in prepared}
    fields = {"base_model": base_model, "dtype": target or (tags.pop() if len(tags) == 1 else None), "run_id": run_id}
    published = published_config(config, info.target_modules)
    refused = adapter_step_problem(info, published, step=step, tensor_count=len(prepared), **fields)
    if refused is not None:
        rule, why = refused
        raise PublishRefused(
            f"adapter step {step}: {why}. Every replica would reject the step; nothing was published",
            tensor="",
            rule=rule,
        )
    with atomic_step_dir(root, step) as tmp:
        files = {
            ADAPTER_WEIGHTS_NAME: _write_shard(tmp / ADAPTER_WEIGHTS_NAME, prepared),
            ADAPTER_CONFIG_NAME: write_small(tmp / ADAPTER_CONFIG_NAME, adapter_config_json(published)),
        }
        write_seconds = time.perf_counter() - t0
        manifest = write_manifest(tmp, step, files, tensor_count=len(prepared), kind="adapter", adapter=info, **fields)
    final = Path(root) / step_dir_name(step)
    total = time.perf_counter() - t0
    log.info(
        "published adapter %s: rank %d on %s, %d tensors, %.2f MB in %.3f s",
        final,
        info.rank,
        ",".join(info.target_modules),
        len(prepared),
        manifest.total_bytes / 1e6,
        total,
    )
    return PublishResult(
        path=final,
        step=step,
        weight_version=manifest.weight_version,
        total_bytes=manifest.total_bytes,
        tensor_count=len(prepared),
        files=len(files),
        write_seconds=write_seconds,
        total_seconds=total,
        kind="adapter",
        fingerprint=manifest.fingerprint(),
        full_bytes=manifest.total_bytes,
    )
