"""Reading the training model's full weights under the names a Hugging Face checkpoint uses.

:func:`iter_full_weights` yields ``(name, full tensor)`` one parameter at a time, whatever
holds the parameters: a plain module, DDP (unwrapped), FSDP2 (``DTensor.full_tensor()``), FSDP1
(``FullyShardedDataParallel.summon_full_params``, accelerate's default FSDP version),
DeepSpeed ZeRO-3 (``deepspeed.zero.GatheredParameters`` per parameter) or PEFT (adapters merged
into the base weights for the duration, ``base_model.model.`` / ``.base_layer`` stripped, LoRA
tensors skipped, then unmerged), as TRL does for vLLM. Gathering is collective under FSDP and
ZeRO-3: every process must exhaust the iterator, also processes that publish nothing.

A yielded tensor is either the live parameter (plain modules, DDP: valid while the model is
not updated) or a private copy (PEFT merged weights, ZeRO-3 gathered buffers, FSDP1 summoned
parameters, FSDP2 full tensors), because the checkpoint writer keeps one shard's tensors before
writing them. Copies are made on the main process only (``accelerator.is_main_process``): the
other processes only take part in the collective gathers and write nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP / DeepSpeed-engine / torch.compile wrappers (``.module``, ``._orig_mod``)."""
    seen = 0
    while seen < 8:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) or type(model).__name__ == "DeepSpeedEngine":
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            break
        seen += 1
    return model


def is_zero3(accelerator: Any) -> bool:
    """True when the accelerator runs DeepSpeed ZeRO stage 3."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    return bool(plugin is not None and getattr(plugin, "zero_stage", 0) == 3)


def is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def clean_name(name: str, peft_prefix: str | None = None) -> str | None:
    """The Hugging Face checkpoint name of a parameter, or None when it must not be published."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    if peft_prefix is not None:
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if peft_prefix in name or "original_module" in name:
            return None
        name = name.replace("modules_to_save.default.", "")
    return name


def is_fsdp1(model: nn.Module) -> bool:
    """True when ``model`` is (or holds) a ``FullyShardedDataParallel`` (FSDP version 1) module."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def iter_full_weights(model: nn.Module, accelerator: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every parameter of ``model`` as ``(hf_name, full tensor)``; see the module docstring."""
    model = unwrap_model(model)
    zero3 = is_zero3(accelerator)
    fsdp1 = is_fsdp1(model)
    device = getattr(accelerator, "device", None)
    # Only the main process writes the checkpoint; the others only take part in the gathers, so
    # they never pay for a private copy.
    writes = bool(getattr(accelerator, "is_main_process", True))
    if is_peft(model):
        prefix = getattr(model, "prefix", "lora_")
        # Merging needs every shard of the base weights at once.
        with _fsdp1_full_params(model, fsdp1), _gathered(list(model.parameters()), zero3):
            model.merge_adapter()
            try:
                for name, param in model.named_parameters():
                    hf_name = clean_name(name, prefix)
                    if hf_name is None:
                        continue
                    # A copy: the merged values vanish at unmerge, which runs as soon as the
                    # writer has drawn the last tensor, before it writes that shard.
                    full = _full(param, device)
                    yield hf_name, full.clone() if writes else full
            finally:
                model.unmerge_adapter()
        return
    if fsdp1:
        # FSDP1 holds flat shards (`_flat_param`); summon_full_params restores the original
        # parameters, full, on every process (as TRL does for vLLM). They are resharded when the
        # context ends, which can come before the writer writes its last shard: the writer gets
        # copies. Peak memory: the whole unsharded model on each process while this runs.
        with _fsdp1_full_params(model, True):
            for name, param in model.named_parameters():
                hf_name = clean_name(name)
                assert hf_name is not None
                full = param.detach()
                yield hf_name, full.clone() if writes else full
        return
    for name, param in model.named_parameters():
        hf_name = clean_name(name)
        assert hf_name is not None
        with _gathered([param], zero3):
            full = _full(param, device)
            # ZeRO-3 frees the gathered buffer at the next step; the writer keeps a shard's
            # tensors until it writes the shard, so it gets a copy (the main process only).
            yield hf_name, full.clone() if zero3 and writes else full


@contextlib.contextmanager
def _fsdp1_full_params(model: nn.Module, fsdp1: bool) -> Iterator[None]:
    if not fsdp1:
        yield
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(model, recurse=True, writeback=False):
        yield


def _full(param: torch.Tensor, device: Any) -> torch.Tensor:
    data = param.detach()
    full_tensor = getattr(data, "full_tensor", None)
    if full_tensor is not None:  # FSDP2 / any DTensor: an all-gather over the mesh
        if data.device.type == "cpu" and device is not None and torch.device(device).type != "cpu":
            data = data.to(device)  # CPU-offloaded shards: the collective runs on the accelerator
        return data.full_tensor()
    return data


@contextlib.contextmanager
def _gathered(params: list[torch.Tensor], zero3: bool) -> Iterator[None]:
    if not zero3:
        yield
        return
    try:
        import deepspeed
    except ImportError as exc:
        raise RuntimeError(
            "the accelerator runs DeepSpeed ZeRO-3 but `import deepspeed` fails; install deepspeed in the "
            "trainer's environment"
        ) from exc
    with deepspeed.zero.GatheredParameters(params):
        yield
