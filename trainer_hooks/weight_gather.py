"""Reading the training model's full weights under the names a Hugging Face checkpoint uses.

:func:`iter_full_weights` yields ``(name, full tensor)`` one parameter at a time, whatever
holds the parameters: a plain module, DDP (unwrapped), FSDP2 (``DTensor.full_tensor()``), FSDP1
(``FullyShardedDataParallel.summon_full_params`` one unit at a time, accelerate's default
FSDP version; merged PEFT models: all units at once),
DeepSpeed ZeRO-3 (``deepspeed.zero.GatheredParameters`` per parameter, through TRL's
``DistributedBackend``) or PEFT (each tuner layer merged into its base weights while they are
drawn, then its base weights restored exactly, ``base_model.model.`` / ``.base_layer`` stripped,
LoRA tensors skipped), as TRL does for vLLM. Gathering is collective under FSDP and
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
from types import SimpleNamespace
from typing import Any

import torch
from accelerate.utils import extract_model_from_parallel, is_peft_model
from torch import nn
from trl.distributed import DistributedBackend

# What TRL 1.16 and accelerate provide is used as is: accelerate's ``extract_model_from_parallel``
# (unwrapping) and ``is_peft_model``, TRL's ``DistributedBackend`` (the ZeRO stage, and ZeRO-3's
# per-parameter ``GatheredParameters``). What they lack is kept here: TRL's name fixing and its
# FSDP1 / FSDP2 walks are private methods of its ``VLLMGeneration`` (``_fix_param_name_to_vllm``,
# ``_iter_fsdp1_params``, ``_iter_fsdp2_params``), and its ``summon_full_params`` acts only when
# accelerate's FSDP plugin says version 1, while a model can be FSDP1-wrapped without the plugin
# (``is_fsdp1`` looks at the modules themselves).

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The trained model inside DDP, DataParallel, DeepSpeed-engine, FSDP1 and torch.compile
    wrappers (accelerate's ``extract_model_from_parallel``)."""
    return extract_model_from_parallel(model, keep_torch_compile=False)


def distributed_backend(accelerator: Any) -> DistributedBackend:
    """TRL's view of the accelerator's DeepSpeed / FSDP set-up; a plain one without an accelerator
    (``None``, or one without accelerate's state)."""
    # TRL reads only the two plugin fields, and without getattr: a state lacking them (a stand-in,
    # another accelerate) counts as no DeepSpeed and no FSDP rather than an AttributeError.
    state = getattr(accelerator, "state", None)
    plugins = SimpleNamespace(
        deepspeed_plugin=getattr(state, "deepspeed_plugin", None), fsdp_plugin=getattr(state, "fsdp_plugin", None)
    )
    return DistributedBackend(SimpleNamespace(state=plugins))


def unwrapped_name(name: str) -> str:
    """A parameter's or module's name without the prefixes wrappers add (FSDP1 units, activation
    checkpointing, ``torch.compile``): FSDP1 shows them in ``named_modules()`` but not in the
    parameter names ``summon_full_params`` restores."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def clean_name(name: str, peft_prefix: str | None = None, adapter: str = "default") -> str | None:
    """The Hugging Face checkpoint name of a parameter, or None when it must not be published
    (a PEFT model's adapter weights, and the copies ``modules_to_save`` keeps of its module: the
    original's, and other adapters' than the active ``adapter``)."""
    name = unwrapped_name(name)
    if peft_prefix is not None:
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        if peft_prefix in name or "original_module" in name:
            return None
        saved, kept = ".modules_to_save.", f".modules_to_save.{adapter}."
        if saved in name:
            if kept not in name:
                return None  # another adapter's trained copy
            name = name.replace(kept, ".")
    return name


def active_adapter(model: nn.Module) -> str:
    """The name of the PEFT model's active adapter (the one merged and published); ``default``
    when it names none or several."""
    active = getattr(model, "active_adapter", "default")
    return active if isinstance(active, str) else "default"


def merged_sync_problem(model: nn.Module) -> str | None:
    """Why the merged weights of the PEFT model ``model`` cannot be what SGLang serves (every
    sidecar would refuse every version); None when they can (or ``model`` is no PEFT model).

    - ``trainable_token_indices``: PEFT keeps the trained rows apart from the embedding (a
      ``token_adapter``), which the merged sync does not fold back;
    - a model whose input and output embeddings are tied (``tie_word_embeddings``) with either of
      them adapted or in ``modules_to_save``: training unties them, but the served model holds one
      tensor for both (it has no ``lm_head.weight``), so the trained head cannot be served;
    - a quantized base (QLoRA): PEFT's merge re-quantizes packed weights (the base drifts) and
      replaces the parameters it merges, so what would be published is neither served nor trained."""
    if not isinstance(model, nn.Module) or not is_peft_model(model):  # (a stand-in: nothing to judge)
        return None
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper, TrainableTokensWrapper

    base = unwrap_model(model).get_base_model()
    if _is_quantized(base):
        return (
            "the base model is quantized (bitsandbytes/GPTQ/... : QLoRA): merging the adapter into packed"
            " weights re-quantizes them, which changes the frozen base at every sync, and publishes weights"
            " SGLang cannot load as the served model's. Sync the adapter instead (start SGLang with"
            " `rollout-service serve ... --lora`, serving the unquantized base), or train on an unquantized base"
        )
    embeddings = {"input embeddings": base.get_input_embeddings(), "output embeddings": base.get_output_embeddings()}
    if any(isinstance(m, TrainableTokensWrapper) for m in embeddings.values()):
        return (
            "PEFT's trainable_token_indices is not synced: PEFT keeps the trained token rows apart from the"
            " embedding, and the merged checkpoint would not hold them where SGLang reads them. Train the"
            " embedding whole (modules_to_save=['embed_tokens'], untied models) or leave it frozen"
        )
    adapted = [what for what, m in embeddings.items() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
    if adapted and bool(getattr(base.config, "tie_word_embeddings", False)):
        return (
            f"the model ties its input and output embeddings (tie_word_embeddings), and its {' and '.join(adapted)}"
            " are adapted or in modules_to_save: training unties them, but SGLang serves the tied model (one"
            " tensor for both, no lm_head.weight), so the synced checkpoint cannot be what is trained. Leave"
            " embed_tokens and lm_head out of target_modules and modules_to_save, or untie the model before"
            " training (and serve the untied model)"
        )
    return None


def _is_quantized(base: nn.Module) -> bool:
    """Whether transformers loaded ``base`` quantized (its quantizer, or the 4/8-bit flags), or a
    parameter of it holds packed, non-floating values."""
    if getattr(base, "hf_quantizer", None) is not None or getattr(base, "is_quantized", False) is True:
        return True
    if getattr(base, "is_loaded_in_4bit", False) is True or getattr(base, "is_loaded_in_8bit", False) is True:
        return True
    return any(not p.dtype.is_floating_point for p in base.parameters())


def is_fsdp1(model: nn.Module) -> bool:
    """True when ``model`` is (or holds) a ``FullyShardedDataParallel`` (FSDP version 1) module."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def iter_full_weights(model: nn.Module, accelerator: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every parameter of ``model`` as ``(hf_name, full tensor)``; see the module docstring."""
    fsdp1 = is_fsdp1(model)
    if not fsdp1:
        # An FSDP1 root stays wrapped: its flat parameter holds the weights no inner unit owns,
        # and summon_full_params restores them only through it (clean_name drops its prefixes).
        model = unwrap_model(model)
    dist = distributed_backend(accelerator)
    device = getattr(accelerator, "device", None)
    # Only the main process writes the checkpoint; the others only take part in the gathers, so
    # they never pay for a private copy.
    writes = bool(getattr(accelerator, "is_main_process", True))
    if is_peft_model(model):
        prefix = getattr(model, "prefix", "lora_")
        allowed = getattr(getattr(model, "base_model", None), "_check_merge_allowed", None)
        if allowed is not None:  # as PEFT's merge_adapter asks first (a quantized base cannot merge)
            allowed()
        owners = _tuner_layers_by_param(model)
        adapter = active_adapter(model)
        # Merging needs every shard of the base weights at once.
        with _fsdp1_full_params(model, fsdp1), dist.gather_params(list(model.parameters())):
            for name, param in model.named_parameters():
                hf_name = clean_name(name, prefix, adapter)
                if hf_name is None:
                    continue
                with _merged_exactly(owners.get(unwrapped_name(name))):
                    # A copy: the merged values vanish when the layer is restored, as soon as the
                    # writer has drawn the tensor, before it writes that shard.
                    full = _full(param, device)
                    yield hf_name, full.clone() if writes else full
        return
    if fsdp1:
        # FSDP1 holds flat shards (`_flat_param`); each unit's summon_full_params restores its
        # original parameters, full, on every process, one unit at a time (as TRL does for vLLM):
        # see _fsdp1_unit_walk. A unit is resharded when the walk leaves it, which can come
        # before the writer writes its last shard: the writer gets copies.
        for name, param in _fsdp1_unit_walk(model, "", {}):
            hf_name = clean_name(name)
            assert hf_name is not None
            full = param.detach()
            yield hf_name, full.clone() if writes else full
        return
    for name, param in model.named_parameters():
        hf_name = clean_name(name)
        assert hf_name is not None
        with dist.gather_params([param]):
            full = _full(param, device)
            # ZeRO-3 frees the gathered buffer at the next step; the writer keeps a shard's
            # tensors until it writes the shard, so it gets a copy (the main process only).
            yield hf_name, full.clone() if dist.is_zero3 and writes else full


def _tuner_layers_by_param(model: nn.Module) -> dict[str, Any]:
    """Each PEFT tuner layer (LoRA, DoRA, ...) by the names of its base layer's own parameters,
    which merging it changes (without wrappers' prefixes: :func:`unwrapped_name`)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    owners: dict[str, Any] = {}
    for module_name, module in model.named_modules():
        base = getattr(module, "base_layer", None)
        if isinstance(module, BaseTunerLayer) and isinstance(base, nn.Module):
            for param_name, _ in base.named_parameters(recurse=False):
                owners[unwrapped_name(f"{module_name}.base_layer.{param_name}")] = module
    return owners


@contextlib.contextmanager
def _merged_exactly(layer: Any) -> Iterator[None]:
    """``layer``'s adapters merged into its base weights for the duration (PEFT's own merge: LoRA,
    DoRA, ...), then its base weights put back bit for bit. PEFT's unmerge subtracts the delta
    again, and in bf16/fp16 ``W + d - d`` is not ``W``: the frozen base drifted at every sync
    (6% of a layer's elements after one sync, 66% after 100, measured). One layer at a time: the
    copy kept is one layer's, not the model's."""
    if layer is None:
        yield
        return
    from peft.tuners.tuners_utils import onload_layer

    with torch.no_grad(), onload_layer(layer):
        saved = [(p, p.detach().clone()) for p in layer.base_layer.parameters(recurse=False)]
        layer.merge()
        try:
            yield
        finally:
            layer.unmerge()  # PEFT's own bookkeeping (merged_adapters, DoRA's cached norms)
            for param, value in saved:
                param.copy_(value)


def _fsdp1_unit_walk(unit: nn.Module, prefix: str, seen: dict[int, nn.Parameter]) -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters under the FSDP1 ``unit``, in ``named_parameters`` order (so the shards a
    sync writes are laid out as without FSDP), each full while it is drawn: the unit's own are
    summoned (``recurse=False``) for its walk, and each nested unit only while the walk is inside
    it. Peak memory: the units on the path from the root to the current one (the root's own
    parameters, embeddings and head, and one decoder layer), not the whole unsharded model. A
    parameter tied to another (FSDP1 keeps both in one unit) is drawn once, as
    ``named_parameters`` does (``seen`` holds the drawn ones, so that an id is never reused by
    another unit's summoned parameter; a resharded unit's storage is freed all the same)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(unit, recurse=False, writeback=False):
        yield from _module_walk(unit, prefix, seen)


def _module_walk(module: nn.Module, prefix: str, seen: dict[int, nn.Parameter]) -> Iterator[tuple[str, nn.Parameter]]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    for name, param in module.named_parameters(recurse=False):
        if id(param) not in seen:
            seen[id(param)] = param
            yield f"{prefix}{name}", param
    for name, child in module.named_children():
        walk = _fsdp1_unit_walk if isinstance(child, FullyShardedDataParallel) else _module_walk
        yield from walk(child, f"{prefix}{name}.", seen)


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
