"""Adapter sync on the trainer: publish the PEFT LoRA adapter instead of the merged model.

:func:`adapter_sync_problem` decides once, at start-up, whether adapter sync can be used: the
model must be a PEFT LoRA model on one process or under DDP (sharded FSDP / ZeRO-3 adapters are
not gathered here), and every SGLang endpoint must serve LoRA within the adapter's needs
(``/server_info``: ``enable_lora``, ``max_lora_rank``, ``lora_target_modules``), and the adapter as
published must pass the sidecar's own checks (:mod:`rollout_service.adapter_reader`: its config
and its tensors against this model's base weights). When it cannot, the trainer syncs merged full
checkpoints and logs the reason once.

:class:`AdapterPublisher` then publishes each version as an ``adapter`` step (``adapter_writer``:
PEFT's file names, the same atomic publication as full checkpoints) through the trainer's
:class:`~trainer_hooks.checkpoint_publisher.CheckpointPublisher` bookkeeping (versions, waiting for
every replica, pruning, sync records; its public :meth:`~CheckpointPublisher.publish_prepared`),
always on the calling thread: an adapter is small. The
rollouts of a version name its adapter (``lora_path``) and carry its version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import torch
from accelerate.utils import is_peft_model

from rollout_service.adapter_reader import LoraLimits, adapter_support_problem, check_adapter_tensors
from rollout_service.adapter_writer import (
    adapter_info,
    adapter_specs,
    adapter_step_problem,
    publish_adapter,
    published_config,
)
from rollout_service.base_values import DIGESTIBLE_DTYPES, SAMPLE_ELEMENTS, pick_base_tensors, values_digest
from rollout_service.bounded_http import client as bounded_client
from rollout_service.bounded_http import request
from rollout_service.checkpoint_format import BaseTensor, CheckpointError
from rollout_service.checkpoint_reader import TensorSpecs
from rollout_service.checkpoint_writer import _TORCH_TO_TAG, PublishResult
from rollout_service.http_auth import bearer_headers
from rollout_service.protocol import adapter_name_for, step_for_version

from .checkpoint_dtype import target_dtype
from .checkpoint_publisher import CheckpointPublisher, SyncRecord
from .weight_gather import active_adapter, clean_name, distributed_backend, is_fsdp1, unwrap_model

log = logging.getLogger(__name__)

ADAPTER_NAME = "default"
"""The PEFT adapter that is trained and synced (TRL trains PEFT's ``default`` adapter)."""


def peft_adapter_config(model: torch.nn.Module) -> dict[str, Any] | None:
    """The trained adapter's ``LoraConfig`` as a dict, or None when ``model`` is not a PEFT model."""
    model = unwrap_model(model)
    if not is_peft_model(model):
        return None
    config = getattr(model, "peft_config", {}).get(ADAPTER_NAME)
    return None if config is None else config.to_dict()


def server_lora_limits(
    urls: Sequence[str], api_key: str | None, timeout_s: float = 30.0
) -> list[tuple[str, LoraLimits | str]]:
    """Each endpoint's LoRA limits from ``/server_info``, or why they could not be read."""
    found: list[tuple[str, LoraLimits | str]] = []
    with bounded_client(timeout=timeout_s, headers=bearer_headers(api_key), trust_env=False) as client:
        for url in urls:
            try:
                r = request(client, "GET", f"{url.rstrip('/')}/server_info", timeout_s=timeout_s)
                if r.status_code != 200:
                    raise ValueError(f"HTTP {r.status_code}")
                found.append((url, LoraLimits.from_server_info(r.json())))
            except (httpx.HTTPError, ValueError, AttributeError) as exc:
                found.append((url, f"cannot read {url}/server_info ({type(exc).__name__}: {str(exc)[:120]})"))
    return found


def served_full_checkpoint(urls: Sequence[str], api_key: str | None, timeout_s: float = 30.0) -> str | None:
    """Why an endpoint cannot load adapters now: it serves a full checkpoint (``/model_info``'s
    ``weight_version`` names a step: an earlier run's merged sync replaced its base model, and every
    adapter is refused until SGLang restarts on its base); None when none does, or none says."""
    with bounded_client(timeout=timeout_s, headers=bearer_headers(api_key), trust_env=False) as client:
        for url in urls:
            try:
                r = request(client, "GET", f"{url.rstrip('/')}/model_info", timeout_s=timeout_s)
                data = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                continue  # (the sidecar judges again at each load)
            served = step_for_version(data.get("weight_version")) if isinstance(data, dict) else None
            if served is not None:
                return (
                    f"{url} serves the full checkpoint version {served} (an earlier run's merged sync), not its"
                    " base model, and loads adapters only on its base: restart SGLang on its base model to"
                    " sync adapters"
                )
    return None


def adapter_sync_problem(
    model: torch.nn.Module, accelerator: Any, urls: Sequence[str], api_key: str | None, dtype: str | None = None
) -> str | None:
    """Why adapter sync cannot be used for ``model`` with these endpoints; None when it can.

    The sidecars judge what is published, so this judges it too: the PEFT config, then the
    adapter as :func:`publish_adapter` would write it in ``dtype`` (:func:`published_adapter_problem`).
    An adapter every sidecar would reject would otherwise end the training at its first sync."""
    config = peft_adapter_config(model)
    if config is None:
        return "the model is not a PEFT LoRA model"
    backend = distributed_backend(accelerator)
    if (
        backend.is_zero3
        or backend.is_fsdp  # judged before `prepare` shards the model: the plugin says it will be
        or is_fsdp1(model)
        or any(hasattr(p, "full_tensor") for p in model.parameters())
    ):
        return "the adapter is sharded (DeepSpeed ZeRO-3 or FSDP); adapter sync gathers unsharded adapters only"
    servers: list[tuple[str, LoraLimits]] = []
    for url, limits in server_lora_limits(urls, api_key):
        if isinstance(limits, str):
            return limits
        problem = adapter_support_problem(config, limits)
        if problem is not None:
            return f"{url}: {problem}"
        if limits.max_rank is None:  # SGLang took it from its --lora-paths, and refuses any adapter above it
            return (
                f"{url} does not say the largest LoRA rank it serves (started without --max-lora-rank: SGLang"
                " took it from its --lora-paths), so an adapter above it would be refused at its first sync;"
                " start SGLang with --max-lora-rank (rollout-service serve --lora does) to sync adapters"
            )
        servers.append((url, limits))
    return published_adapter_problem(model, config, dtype, servers) or served_full_checkpoint(urls, api_key)


def published_adapter_problem(
    model: torch.nn.Module, config: dict[str, Any], dtype: str | None, servers: Sequence[tuple[str, LoraLimits]]
) -> str | None:
    """Why the sidecars (``servers``: their URLs and LoRA limits) would reject the adapter as
    published, though its PEFT config passes; None when they would not.

    A PEFT config and the tensors it makes can differ: its ``target_modules`` may name modules the
    model lacks (the published config names the tensors' modules: :func:`published_config`), a
    module inside an ``nn.Sequential`` is named by its index, which no manifest takes, and
    ``exclude_modules`` can leave a module out of some blocks only, which SGLang cannot stack. So
    the step's manifest and config get the checks :func:`publish_adapter` makes before it writes
    (:func:`adapter_step_problem`: it would refuse every version), and the state dict's names,
    dtypes and shapes the sidecar's own checks (:func:`check_adapter_tensors`) against this model's
    base weights."""
    from peft import get_peft_model_state_dict

    model = unwrap_model(model)
    tensors = get_peft_model_state_dict(model, adapter_name=ADAPTER_NAME)
    try:
        info = adapter_info(tensors, config)
        published = published_config(config, info.target_modules)
        refused = adapter_step_problem(info, published, tensor_count=len(tensors))
        if refused is not None:  # publish_adapter would refuse every version (PublishRefused)
            return f"every sidecar would reject the adapter's step ({refused[0]}): {refused[1]}"
        for url, limits in servers:
            problem = adapter_support_problem(published, limits)
            if problem is not None:
                return f"{url}: the adapter as published: {problem}"
        specs = adapter_specs(tensors, dtype)
        modules = set(info.target_modules)
        check_adapter_tensors(specs, base_weight_specs(model), info.rank, modules, where="the adapter's tensors")
    except CheckpointError as exc:
        return f"every sidecar would reject the adapter ({exc.reason}): {exc}"
    except ValueError as exc:  # no LoRA tensors at all
        return str(exc)
    return None


def _base_parameters(model: torch.nn.Module) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """(checkpoint name, parameter name, parameter) of each base weight of a PEFT model; its
    LoRA weights are left out."""
    prefix = getattr(model, "prefix", "lora_")
    adapter = active_adapter(model)
    for name, param in model.named_parameters():
        hf_name = clean_name(name, prefix, adapter)
        if hf_name is not None:
            yield hf_name, name, param


def base_weight_specs(model: torch.nn.Module) -> TensorSpecs:
    """A PEFT model's base weights as a sidecar's reference lists the served model's (checkpoint
    name -> dtype, shape), for the adapter's tensors to be checked against. A linear layer's
    weight is ``[out_features, in_features]`` also where its parameter is packed (quantized)."""
    layers = dict(model.named_modules())
    specs: TensorSpecs = {}
    for hf_name, name, param in _base_parameters(model):
        layer = layers.get(name.rpartition(".")[0])
        out_dim, in_dim = getattr(layer, "out_features", None), getattr(layer, "in_features", None)
        linear = name.endswith(".weight") and isinstance(out_dim, int) and isinstance(in_dim, int)
        shape = (out_dim, in_dim) if linear else tuple(param.shape)
        specs[hf_name] = (str(param.dtype).removeprefix("torch."), shape)
    return specs


def base_values_of(model: torch.nn.Module) -> dict[str, BaseTensor]:
    """A few of a PEFT model's base weights, by checkpoint name, with the dtype it holds them in
    and the digest of their values (:mod:`rollout_service.base_values`: the first and last
    weights the adapter changes and one-dimensional ones). Read once, at start-up: the base
    weights are frozen."""
    params: dict[str, torch.Tensor] = {}
    adapted: set[str] = set()
    for hf_name, name, param in _base_parameters(model):
        if param.dtype not in _HELD_AS:
            continue
        params[hf_name] = param
        if ".base_layer." in name and hf_name.endswith(".weight"):  # not a bias
            adapted.add(hf_name)
    picked = pick_base_tensors({n: tuple(p.shape) for n, p in params.items()}, adapted)
    with torch.no_grad():
        return {
            n: BaseTensor(
                dtype=_HELD_AS[params[n].dtype],
                digest=values_digest(
                    params[n].detach().reshape(-1)[:SAMPLE_ELEMENTS].float().cpu().numpy(), _HELD_AS[params[n].dtype]
                ),
            )
            for n in picked
        }


_HELD_AS = {dtype: tag for dtype, tag in _TORCH_TO_TAG.items() if tag in DIGESTIBLE_DTYPES}
"""The base tensor dtypes an adapter step can record (others, e.g. quantized weights, are not picked)."""


class AdapterPublisher:
    """Publishes the trained LoRA adapter as the next version and waits for the replicas."""

    def __init__(self, publisher: CheckpointPublisher, model: torch.nn.Module, dtype: str | None):
        self.publisher = publisher
        self.model = unwrap_model(model)
        self.dtype = dtype
        config = peft_adapter_config(self.model)
        if config is None:
            raise TypeError(f"AdapterPublisher needs a PEFT LoRA model, got {type(self.model).__name__}")
        self.config: dict[str, Any] = config
        self.base_values = base_values_of(self.model)
        """Digests of a few frozen base weights, in every adapter step's manifest: which base the
        adapter belongs to (the sidecars compare them with the model SGLang serves)."""

    def current(self) -> tuple[int, str] | None:
        """(version, adapter name) of the newest version every replica serves; None before the first."""
        version = self.publisher.confirmed_version
        return None if version is None else (version, adapter_name_for(version, self.publisher.run_id))

    def publish_and_wait(self) -> SyncRecord:
        """Publish the adapter as the next version, wait for every replica, record the sync.

        An adapter every replica would reject (NaN/Inf weights after the training diverged, as cast
        to the checkpoint dtype) raises :class:`~rollout_service.checkpoint_writer.PublishRefused`
        as a full publish does: nothing is published, no replica is woken or waited for, and the
        last adapter served stays the newest."""
        from peft import get_peft_model_state_dict

        pub = self.publisher
        pub.join()
        t0 = time.perf_counter()
        want = target_dtype(self.dtype)
        state = {
            name: t.detach().to("cpu", dtype=want if want is not None and t.is_floating_point() else t.dtype)
            for name, t in get_peft_model_state_dict(self.model, adapter_name=ADAPTER_NAME).items()
        }
        gather_s = time.perf_counter() - t0

        def write(version: int) -> PublishResult:
            return publish_adapter(
                pub.root,
                version,
                state,
                self.config,
                dtype=self.dtype,
                base_model=pub.base_model,
                run_id=pub.run_id,
                base_values=self.base_values,
            )

        return pub.publish_prepared(pub.next_version(), write, prepared_s=gather_s).result()


def choose_adapter_sync(
    publisher: CheckpointPublisher, model: torch.nn.Module, accelerator: Any, args: Any, dtype: str | None
) -> AdapterPublisher | None:
    """An :class:`AdapterPublisher` when adapter sync applies (``args.adapter_sync`` and no
    :func:`adapter_sync_problem`); else None, with one log line saying why for a PEFT model."""
    if peft_adapter_config(model) is None:
        return None
    if not getattr(args, "adapter_sync", True):
        log.info("adapter sync off (adapter_sync=False): syncing the merged model as full checkpoints")
        return None
    api_key = getattr(args, "sglang_api_token", None)
    problem = adapter_sync_problem(model, accelerator, args.sglang_urls, api_key, dtype)
    if problem is not None:
        log.warning(
            "LoRA adapter sync is not possible, syncing the merged model as full checkpoints instead: %s", problem
        )
        return None
    log.info("LoRA adapter sync: each version is published as an adapter and served with SGLang's LoRA support")
    return AdapterPublisher(publisher, model, dtype)


BASE_REPLACED = "on full checkpoint "
"""How :func:`label_with_adapter` labels a completion whose adapter ran on a full checkpoint
loaded over SGLang's base model (``raw_weight_version``; ``weight_version`` None)."""


def label_with_adapter(groups: list[list[Any]], version: int, name: str) -> None:
    """Completions generated with adapter ``name`` carry its version, when SGLang ran it on its
    base model: SGLang's own weight version is then its start-up one, no checkpoint's. One
    answered with a checkpoint's version ran the adapter on a full checkpoint loaded over the
    base (another run's, or a full publish into this root; SGLang keeps adapters loaded across a
    weight update): labelled :data:`BASE_REPLACED` and that version, with none of its own, so
    the staleness check refuses it instead of taking it for adapter version ``version``."""
    for group in groups:
        for completion in group:
            if completion.weight_version is not None:
                completion.raw_weight_version = f"{name} {BASE_REPLACED}{completion.weight_version}"
                completion.weight_version = None
            else:
                completion.weight_version = version
                completion.raw_weight_version = name
