"""Atomic publication of a PEFT LoRA adapter as an ``adapter`` checkpoint step.

``publish_adapter`` writes what PEFT's ``save_pretrained`` writes (``adapter_model.safetensors``
with names like ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, and
``adapter_config.json``) plus the manifest, through the same hidden work folder, fsyncs and
single rename as a full checkpoint (:func:`~rollout_service.checkpoint_writer.atomic_step_dir`),
so readers see an adapter step completely or not at all.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .checkpoint_format import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    AdapterInfo,
    FileEntry,
    normalize_dtype,
    step_dir_name,
)
from .checkpoint_writer import (
    PublishResult,
    atomic_step_dir,
    check_run_id,
    shard_prefix,
    write_manifest,
    write_small,
)
from .digest import format_digest, new_hasher

log = logging.getLogger(__name__)

LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_TAGS = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


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


def _write_tensors(path: Path, tensors: list[tuple[str, torch.Tensor]]) -> FileEntry:
    prefix, _ = shard_prefix((n, _TAGS[t.dtype], tuple(t.shape)) for n, t in tensors)
    hasher = new_hasher()
    hasher.update(prefix)
    size = len(prefix)
    with open(path, "wb") as f:
        f.write(prefix)
        for _, t in tensors:
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            hasher.update(raw)
            f.write(raw)
            size += len(raw)
        f.flush()
        os.fsync(f.fileno())
    return FileEntry(size=size, digest=format_digest(hasher), tensors=len(tensors))


def publish_adapter(
    root: Path | str,
    step: int,
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    *,
    dtype: str | None = None,
    base_model: str | None = None,
    run_id: str | None = None,
) -> PublishResult:
    """Publish a LoRA adapter as ``<root>/step-<step>`` (kind ``adapter``) atomically.

    ``tensors`` are PEFT's saved names (``get_peft_model_state_dict``), ``config`` the adapter's
    ``LoraConfig.to_dict()``; ``dtype`` casts floating tensors. Raises ``FileExistsError`` if
    the step is already published, ``ValueError`` when there are no LoRA tensors.
    """
    t0 = time.perf_counter()
    target = normalize_dtype(dtype)
    run_id = check_run_id(run_id)
    info = adapter_info(tensors, config)
    want = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(target or "")
    prepared = []
    for name in sorted(tensors):
        t = tensors[name].detach()
        if want is not None and t.is_floating_point():
            t = t.to(want)
        t = t.to("cpu").contiguous()
        if t.dtype not in _TAGS:
            raise ValueError(f"adapter tensor {name} has dtype {t.dtype}; publish float32, float16 or bfloat16")
        prepared.append((name, t))
    tags = {_TAGS[t.dtype] for _, t in prepared}
    with atomic_step_dir(root, step) as tmp:
        files = {
            ADAPTER_WEIGHTS_NAME: _write_tensors(tmp / ADAPTER_WEIGHTS_NAME, prepared),
            ADAPTER_CONFIG_NAME: write_small(tmp / ADAPTER_CONFIG_NAME, adapter_config_json(config)),
        }
        write_seconds = time.perf_counter() - t0
        manifest = write_manifest(
            tmp,
            step,
            files,
            base_model=base_model,
            dtype=target or (tags.pop() if len(tags) == 1 else None),
            tensor_count=len(prepared),
            run_id=run_id,
            kind="adapter",
            adapter=info,
        )
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
