"""Drop-in TRL trainers whose rollouts come from SGLang servers synced through a checkpoint root.

:class:`GRPOTrainer` (and :class:`RLOOTrainer`) take exactly the constructor arguments of
TRL's trainers, with ``args`` a :class:`trainer_hooks.config.GRPOConfig` (``RLOOConfig``).
TRL builds its generation backend in ``__init__`` by calling ``VLLMGeneration(...)`` when
``use_vllm`` is set; while the parent constructor runs, that name is bound to a factory that
builds :class:`~trainer_hooks.sglang_generation.SGLangGeneration` from the same arguments
(:func:`build_sglang_generation`, which also wires the main process's parts from the config:
SGLang endpoints, replica waiter, checkpoint publisher, adapter sync, staleness policy).
Everything else stays TRL's: the reward pipeline, evaluation and the importance-sampling
correction (gated on ``use_vllm``) run unchanged on SGLang's completions and logprobs.
Evaluation syncs in the foreground (``evaluate`` below): it generates with the newest weights.

The seam is private to TRL and changes between minor versions, so construction fails on TRL
versions this was not tested with. Sync and rollout metrics (``sglang/sync_*_s``,
``sglang/version_lag``, ...) are logged through the trainer's own metric mechanism.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import trl
from accelerate.utils import broadcast_object_list, is_peft_model
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from trl.trainer import grpo_trainer as _trl_grpo_module
from trl.trainer import rloo_trainer as _trl_rloo_module

from rollout_service.checkpoint_format import DEFAULT_DELTA_MAX_RATIO, DEFAULT_FULL_EVERY, normalize_dtype
from rollout_service.delta_choice import PublishCosts
from rollout_service.delta_writer import DeltaCheckpointWriter

from .adapter_publish import AdapterPublisher, choose_adapter_sync
from .checkpoint_dtype import checkpoint_dtype, target_dtype
from .checkpoint_publisher import WRITE_ALLOWANCE_BYTES_PER_S, CheckpointPublisher
from .config import (
    GRPOConfig,
    RLOOConfig,
    SGLangRolloutArguments,
    collective_budget_s,
    completions_rescored,
    config_sampling_params,
    engine_logprobs_used,
    process_group_timeout_s,
    syncs_in_background,
    translate_generation_kwargs,
)
from .cpu_contention import warn_if_sharing_the_cpu
from .replica_wait import AckFileWaiter, ReplicaWaiter, SidecarWaiter
from .sampling_checks import check_token_ids_in_vocab
from .sglang_endpoints import SGLangEndpoints
from .sglang_generation import SGLangGeneration, raise_everywhere
from .stale_retry import StaleRetryPolicy
from .weight_gather import merged_sync_problem, unwrap_model

logger = logging.getLogger(__name__)

TESTED_TRL_VERSIONS = SpecifierSet(">=1.16.0,<1.17")
"""TRL versions whose generation seam (``VLLMGeneration`` built in ``__init__``, then
``sync_weights()`` / ``generate()``) this module was tested against."""

_INSTALL_LOCK = threading.Lock()


def check_trl_version(version: str | None = None) -> None:
    """Raise RuntimeError unless ``version`` (default: the installed TRL) is a tested one."""
    version = version or trl.__version__
    if Version(version) not in TESTED_TRL_VERSIONS:
        raise RuntimeError(
            f"trainer_hooks was tested with TRL {TESTED_TRL_VERSIONS} but TRL {version} is installed. It plugs "
            "into TRL's private generation seam, which changes between minor versions: install "
            "`trl>=1.16,<1.17` or update trainer_hooks for this TRL"
        )


def build_sglang_generation(
    model: torch.nn.Module,
    accelerator: Any,
    processing_class: Any,
    *,
    args: SGLangRolloutArguments,
    current_step: Callable[[], int] | None = None,
    **sampling: Any,
) -> SGLangGeneration:
    """The SGLang backend for this process, wired from ``args``.

    On the main process: the SGLang endpoints, the replica waiter (the sidecars, or the ack files
    of ``expected_replicas``), the checkpoint publisher (dtype, shards, retention, deltas), LoRA
    adapter sync when it applies, and the staleness policy; a warning when the trainer shares the
    CPU with a busy-polling SGLang. The other processes get none of them. ``sampling`` is
    :class:`SGLangGeneration`'s sampling arguments (``temperature``, ..., ``generation_kwargs``).

    Raises ValueError (on every process, before anything is wired) for a ``stop_token_ids`` entry or
    ``logit_bias`` key in ``generation_kwargs`` outside the model's vocabulary.
    """
    vocab_size = model_vocab_size(model)
    if "generation_kwargs" in sampling:  # again: one set on the config after it was built was never translated
        sampling["generation_kwargs"] = translate_generation_kwargs(sampling["generation_kwargs"])
    check_token_ids_in_vocab(sampling.get("generation_kwargs") or {}, vocab_size)
    publisher = rollouts = adapters = None
    error: Exception | None = None
    if accelerator.is_main_process:
        try:
            publisher, rollouts, adapters = _wire_main_process(model, accelerator, args, vocab_size)
        except Exception as exc:  # raised on every process: the others wait for the main one below
            error = exc
    raise_everywhere(accelerator, error, "building the SGLang backend")
    syncs_adapters = _as_the_main_process_says(accelerator, adapters is not None)
    if not syncs_adapters:
        problem = merged_sync_problem(model)
        if problem is not None:  # every sidecar would refuse every version, after sync_timeout
            if publisher is not None and rollouts is not None:
                publisher.close()
                rollouts.endpoints.close()
            raise ValueError(problem)
    return SGLangGeneration(
        model,
        accelerator,
        processing_class,
        publisher=publisher,
        rollouts=rollouts,
        adapters=adapters,
        syncs_adapters=syncs_adapters,
        current_step=current_step,
        logprobs_used=engine_logprobs_used(args),
        **sampling,
    )


def _as_the_main_process_says(accelerator: Any, value: bool) -> bool:
    """``value`` as the main process found it, on every process (only the main process asks the
    servers whether adapter sync applies, and every process must sync the same way)."""
    if accelerator.num_processes <= 1:
        return value
    box = [value if accelerator.is_main_process else None]
    broadcast_object_list(box, from_process=0)
    return bool(box[0])


def _base_model(model: torch.nn.Module) -> Any:
    """The model under its wrappers (DDP, FSDP, DeepSpeed) and its PEFT adapter: its config and name."""
    base = unwrap_model(model)
    return base.get_base_model() if is_peft_model(base) else base


def model_vocab_size(model: torch.nn.Module | None) -> int | None:
    """How many token ids ``model`` embeds (:func:`_vocab_size` of its base model's text config);
    None when that is not known (no model: the non-main processes of some callers pass none)."""
    if not isinstance(model, torch.nn.Module):
        return None
    base = _base_model(model)
    config = base.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return _vocab_size(base, text_config)


def _wire_main_process(
    model: torch.nn.Module, accelerator: Any, args: SGLangRolloutArguments, vocab_size: int | None
) -> tuple[CheckpointPublisher, StaleRetryPolicy, AdapterPublisher | None]:
    with contextlib.ExitStack() as built:  # closed when a later part fails
        wired = _wire_parts(model, accelerator, args, vocab_size, built)
        built.pop_all()
    return wired


def _wire_parts(
    model: torch.nn.Module,
    accelerator: Any,
    args: SGLangRolloutArguments,
    vocab_size: int | None,
    built: contextlib.ExitStack,
) -> tuple[CheckpointPublisher, StaleRetryPolicy, AdapterPublisher | None]:
    """:func:`_wire_main_process`'s parts, each one that holds resources registered on ``built``."""
    base = _base_model(model)
    config = base.config
    endpoints = SGLangEndpoints(
        args.sglang_urls,
        request_timeout_s=args.sglang_request_timeout,
        vocab_size=vocab_size,
        api_key=args.sglang_api_token,
        log_paths=getattr(args, "sglang_log_paths", None) or (),
        status_urls=args.sidecar_urls or (),
    )
    built.callback(endpoints.close)
    root = args.checkpoint_path
    assert root is not None  # the config refuses to be built without one
    waiter: ReplicaWaiter
    if args.sidecar_urls:
        waiter = SidecarWaiter(args.sidecar_urls, token=args.sidecar_token)
    else:
        assert args.expected_replicas is not None
        waiter = AckFileWaiter(Path(root), args.expected_replicas, max_age_s=args.replica_heartbeat_max_age)
    warn_if_sharing_the_cpu(endpoints)
    dtype = checkpoint_dtype(args.checkpoint_dtype, base)
    _warn_if_a_sync_outlasts_the_process_group(args, base, dtype, accelerator.num_processes)
    config_dict = json.loads(config.to_json_string())
    config_dict["dtype"] = dtype
    # A model made with from_config has no `architectures` until saved; a materialized version
    # (a plain HF model directory) needs it for SGLang or transformers to load it.
    if not config_dict.get("architectures"):
        config_dict["architectures"] = [type(base).__name__]
    publisher = CheckpointPublisher(
        root,
        waiter,
        config=config_dict,
        dtype=dtype,
        max_shard_bytes=int(args.checkpoint_max_shard_mb * 1024 * 1024),
        keep=args.keep_checkpoints,
        sync_timeout_s=args.sync_timeout,
        heartbeat_max_age_s=args.replica_heartbeat_max_age,
        base_model=getattr(base, "name_or_path", None) or None,
        delta=delta_writer_for(args, dtype),
    )
    built.callback(publisher.close)
    adapters = choose_adapter_sync(publisher, model, accelerator, args, dtype)
    rollouts = StaleRetryPolicy(
        endpoints,
        publisher,
        waiter,
        max_staleness=args.max_staleness,
        sync_timeout_s=args.sync_timeout,
        adapters=adapters,
    )
    return publisher, rollouts, adapters


def _warn_if_a_sync_outlasts_the_process_group(args: Any, base: Any, dtype: str, processes: int) -> None:
    """Warn when writing this model's checkpoint could keep the other processes waiting in a
    collective past the process group's timeout: the config's budget (:func:`collective_budget_s`)
    was computed before the model, and so its checkpoint's size, was known."""
    if processes <= 1:
        return
    target = target_dtype(dtype)
    itemsize = target.itemsize if target is not None else 4
    checkpoint_bytes = sum(int(getattr(p, "ds_numel", p.numel())) for p in base.parameters()) * itemsize
    budget = collective_budget_s(
        args.sync_timeout,
        args.sglang_request_timeout,
        completions_rescored(args, config_sampling_params(args)),
        background_syncs=syncs_in_background(args),
        checkpoint_bytes=checkpoint_bytes,
    )
    timeout = process_group_timeout_s(args)
    if budget > timeout:
        logger.warning(
            "a checkpoint of this model (%.1f GB) is given up to %.0f s to write and sync (at %g MB/s) while the "
            "other %d process(es) wait in a collective, longer than the process group's timeout (%g s): on slow "
            "storage the collective watchdog may abort them before the trainer's own error. Raise ddp_timeout to "
            "%d s (with use_cpu=True, lower sync_timeout instead)",
            checkpoint_bytes / 1e9,
            budget,
            WRITE_ALLOWANCE_BYTES_PER_S / 1e6,
            processes - 1,
            timeout,
            int(budget) + 1,
        )


def delta_writer_for(args: Any, dtype: str) -> DeltaCheckpointWriter | None:
    """The delta writer ``checkpoint_delta`` asks for. By default (None) one for 16-bit
    checkpoints, whose unchanged weights are most of the model at RL learning rates (fp32's low
    bits change at nearly every step, so its deltas barely compress), that publishes a delta only
    while deltas measure faster than full publishes on this storage; True: a delta whenever one
    is possible."""
    wanted = getattr(args, "checkpoint_delta", None)
    measured = wanted is None
    if wanted is None:
        wanted = normalize_dtype(dtype) in ("BF16", "F16")
    if not wanted:
        return None
    full_every = getattr(args, "checkpoint_full_every", DEFAULT_FULL_EVERY)
    return DeltaCheckpointWriter(
        full_every=full_every,
        max_ratio=getattr(args, "checkpoint_delta_max_ratio", DEFAULT_DELTA_MAX_RATIO),
        costs=PublishCosts(probe_every=full_every) if measured else None,
    )


def _sglang_factory(config: SGLangRolloutArguments, current_step: Callable[[], int]) -> Callable[..., SGLangGeneration]:
    """A stand-in for ``VLLMGeneration`` taking the keyword arguments TRL passes to it (the sampling
    ones become SGLang's in :func:`~trainer_hooks.config.sglang_sampling_params`, as the config's
    checks saw them)."""

    def build(
        *,
        model: Any,
        accelerator: Any,
        processing_class: Any,
        repetition_penalty: float = 1.0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = 0,
        min_p: float | None = 0.0,
        max_completion_length: int = 16,
        logprobs: int | None = 0,
        generation_kwargs: dict[str, Any] | None = None,
        structured_outputs_regex: str | None = None,
        **vllm_only: Any,
    ) -> SGLangGeneration:
        return build_sglang_generation(
            model,
            accelerator,
            processing_class,
            args=config,
            current_step=current_step,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            max_completion_length=max_completion_length,
            logprobs=logprobs,
            generation_kwargs=generation_kwargs,
            structured_outputs_regex=structured_outputs_regex,
        )

    return build


@contextlib.contextmanager
def _backend_installed(module: ModuleType, factory: Callable[..., SGLangGeneration]) -> Iterator[None]:
    """Bind ``module.VLLMGeneration`` to ``factory`` for the duration (one trainer at a time)."""
    if not hasattr(module, "VLLMGeneration"):
        raise RuntimeError(
            f"{module.__name__} has no VLLMGeneration: this TRL builds its generation backend differently; "
            "trainer_hooks needs updating for it"
        )
    with _INSTALL_LOCK:
        original = module.VLLMGeneration
        module.VLLMGeneration = factory  # type: ignore[attr-defined]  # ModuleType: any attribute
        try:
            yield
        finally:
            module.VLLMGeneration = original  # type: ignore[attr-defined]


class _SGLangBackendMixin:
    """Builds the SGLang backend during TRL's constructor and logs its metrics."""

    _trl_module: ModuleType
    _config_class: type
    vllm_generation: SGLangGeneration

    def _init_with_sglang(self, parent_init: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        check_trl_version()
        bound = inspect.signature(parent_init).bind(self, *args, **kwargs)
        config = bound.arguments.get("args")
        if not isinstance(config, SGLangRolloutArguments):
            name = self._config_class.__name__
            raise TypeError(
                f"{type(self).__name__} needs args=trainer_hooks.{name}(...) with checkpoint_path, sglang_urls and "
                f"sidecar_urls (or expected_replicas); got {type(config).__name__}"
            )
        factory = _sglang_factory(config, lambda: self.state.global_step)  # type: ignore[attr-defined]
        with _backend_installed(self._trl_module, factory):
            parent_init(self, *args, **kwargs)
        if not isinstance(getattr(self, "vllm_generation", None), SGLangGeneration):
            raise RuntimeError(
                "TRL did not build the SGLang generation backend (use_vllm was off?); trainer_hooks needs updating "
                "for this TRL"
            )
        # The model as `train()` wrapped it (transformers' model_wrapped: FSDP's root unit, the
        # DeepSpeed engine, DDP), not the one TRL handed the backend before `prepare`.
        self.vllm_generation.model_source = lambda: getattr(self, "model_wrapped", None) or self.model  # type: ignore[attr-defined]

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``train``, then wait for a background checkpoint sync still in flight (and its errors).

        Whether training ends or fails, the SGLang backend is closed after it: its HTTP client,
        request threads and checkpoint worker are released (and opened again by a later
        ``evaluate()``). A failure to close after a failed run is logged; the run's error is raised.
        """
        try:
            output = super().train(*args, **kwargs)  # type: ignore[misc]
            self.vllm_generation.finish_pending_sync()
        except BaseException:
            try:
                self.vllm_generation.close()
            except Exception as exc:
                logger.warning("closing the SGLang backend after the failed train() failed too: %s", exc)
            raise
        self.vllm_generation.close()
        return output

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``evaluate``, its rollouts generated with the newest weights.

        With ``max_staleness > 0`` a sync runs in the background and rollouts may use weights up to
        ``max_staleness`` versions old: right for training, wrong for evaluation, which after
        ``train()`` would score the weights from before the final steps and leave a sync running
        that nothing waits for. So a background sync still in flight is finished first, and the
        syncs TRL makes during evaluation publish and wait for the replicas before generating."""
        with self.vllm_generation.syncing_in_foreground():
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``predict``, its rollouts generated with the newest weights (as :meth:`evaluate`'s)."""
        with self.vllm_generation.syncing_in_foreground():
            return super().predict(*args, **kwargs)  # type: ignore[misc]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"  # type: ignore[attr-defined]
        for key, values in self.vllm_generation.drain_metrics().items():
            self._metrics[mode][key].extend(values)  # type: ignore[attr-defined]
        super().log(logs, start_time)  # type: ignore[misc]


class GRPOTrainer(_SGLangBackendMixin, trl.GRPOTrainer):
    """TRL's GRPOTrainer generating with SGLang; same constructor, ``args`` a trainer_hooks GRPOConfig."""

    _trl_module = _trl_grpo_module
    _config_class = GRPOConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._init_with_sglang(trl.GRPOTrainer.__init__, *args, **kwargs)


class RLOOTrainer(_SGLangBackendMixin, trl.RLOOTrainer):
    """TRL's RLOOTrainer generating with SGLang; same constructor, ``args`` a trainer_hooks RLOOConfig."""

    _trl_module = _trl_rloo_module
    _config_class = RLOOConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._init_with_sglang(trl.RLOOTrainer.__init__, *args, **kwargs)


def _vocab_size(model: Any, text_config: Any) -> int | None:
    """How many token ids the model embeds: its config's ``vocab_size``, else its input
    embedding's size; None when neither says (token ids are then only bounded by 2**31)."""
    size = getattr(text_config, "vocab_size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    try:
        size = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError, TypeError):
        return None
    return size if isinstance(size, int) and size > 0 else None
