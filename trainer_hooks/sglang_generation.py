"""SGLang as TRL's generation backend: the two calls a TRL trainer makes, and nothing else.

TRL's GRPO and RLOO trainers talk to their generation backend through exactly two methods
(see ``trl/generation/vllm_generation.py``), which :class:`SGLangGeneration` implements:

``sync_weights()``
    Called when ``trainer.state.global_step`` changed since the last sync (TRL keeps
    ``_last_loaded_step``; this class checks again). Every process gathers the full weights
    (collective under FSDP / ZeRO-3); the main process publishes them as the next checkpoint
    version under ``checkpoint_path`` and waits until every expected replica serves it. With
    ``max_staleness > 0`` the write and the wait run in a background thread (after the first
    version, which is always waited for).

``generate(prompts, images, num_generations, profiler)``
    ``prompts`` are this process's prompt token ids, each repeated ``num_generations`` times in a
    row. They are gathered from all processes, de-duplicated with ``[::num_generations]``, sent
    to SGLang as one batch per endpoint with ``n=num_generations``, checked (integer token ids,
    weight version within ``max_staleness`` of the newest checkpoint, else retried after waiting
    for the replica) and scattered back. Returns ``(prompt_ids, completion_ids, logprobs,
    logprob_token_ids)``: lists per completion, logprobs shaped ``[[lp], ...]`` per token (the
    sampled token's logprob after temperature scaling, which is what TRL's importance sampling
    needs; when the sampling parameters change the distribution, e.g. a grammar, the model's own
    logprob read back from SGLang instead, see ``logprob_source``), ``logprob_token_ids``
    likewise ``[[token_id], ...]``.

Errors on the main process (SGLang down, replicas lagging past ``sync_timeout``) are broadcast
to every process, so all of them raise instead of some waiting forever in a collective.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import defaultdict, deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import broadcast_object_list, gather_object

from rollout_service.checkpoint_format import DEFAULT_DELTA_MAX_RATIO, DEFAULT_FULL_EVERY, normalize_dtype
from rollout_service.delta_writer import DeltaCheckpointWriter
from rollout_service.http_auth import is_loopback_url

from .adapter_publish import AdapterPublisher, choose_adapter_sync, label_with_adapter
from .checkpoint_sync import CheckpointPublisher
from .config import SGLangRolloutArguments, rescoring_needed
from .replica_wait import AckFileWaiter, ReplicaSyncTimeout, ReplicaWaiter, SidecarWaiter
from .sglang_endpoints import SGLangEndpoints
from .sglang_responses import Completion
from .weight_gather import is_peft, iter_full_weights, unwrap_model

log = logging.getLogger(__name__)

_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
STALE_RETRY_PAUSE_S = 1.0
STALE_WAIT_SLICE_S = 10.0


class StaleWeightsError(RuntimeError):
    """SGLang kept answering with weights older than the staleness bound allows."""


@dataclass
class GenerationRecord:
    """What one ``generate`` call saw: the version it required and the versions that answered."""

    published_version: int | None
    required_version: int | None
    versions: list[int | None]
    stale_retries: int
    seconds: float


@dataclass
class _Metrics:
    values: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def add(self, key: str, value: float | None) -> None:
        if value is not None:
            self.values[key].append(float(value))


class _ProcessedLogprobsServerInfo:
    """Answers TRL's start-up question to a vLLM server ("which logprobs do you return?").

    SGLang returns each sampled token's logprob after temperature scaling (``processed``), which
    is what TRL's importance-sampling correction expects.
    """

    @staticmethod
    def get_server_info() -> dict[str, Any]:
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}


class SGLangGeneration:
    """TRL's generation seam implemented with SGLang servers and a shared checkpoint root.

    Arguments:
        model: the policy being trained (plain, DDP, FSDP2, DeepSpeed or PEFT model).
        accelerator: the trainer's ``accelerate.Accelerator``.
        processing_class: the trainer's tokenizer or processor (unused: prompts arrive as ids).
        args: the trainer's config (a :class:`~trainer_hooks.config.SGLangRolloutArguments`).

        > Sampling (as TRL passes them to its vLLM backend)

        temperature, top_p, top_k, min_p, repetition_penalty: sampling parameters (``top_k``
            0 or None and ``min_p`` None mean disabled).
        max_completion_length: SGLang's ``max_new_tokens``.
        logprobs: 0 to return the sampled token's logprob (GRPO), None for none (RLOO).
        generation_kwargs: extra SGLang sampling parameters, by SGLang's names; they override
            the ones above.

        > Trainer hook

        current_step: returns the trainer's ``global_step``; ``sync_weights`` does nothing when
            it has not changed since the last sync.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        accelerator: Any,
        processing_class: Any,
        *,
        args: SGLangRolloutArguments,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = 0,
        min_p: float | None = 0.0,
        repetition_penalty: float = 1.0,
        max_completion_length: int = 16,
        logprobs: int | None = 0,
        generation_kwargs: dict[str, Any] | None = None,
        current_step: Callable[[], int] | None = None,
    ) -> None:
        if logprobs not in (None, 0):
            raise ValueError(
                f"logprobs={logprobs} asks for top-{logprobs} logprobs per token; SGLangGeneration returns the "
                "sampled token's logprob only (logprobs=0) or none (logprobs=None)"
            )
        self.model = model
        self.accelerator = accelerator
        self.processing_class = processing_class
        self.args = args
        self.max_staleness = int(args.max_staleness)
        self.sync_timeout = float(args.sync_timeout)
        self.want_logprobs = logprobs is not None
        self.current_step = current_step
        self.sampling_params: dict[str, Any] = {
            "temperature": temperature,
            "top_p": top_p,
            "top_k": -1 if not top_k else int(top_k),
            "min_p": 0.0 if min_p is None else min_p,
            "repetition_penalty": repetition_penalty,
            "max_new_tokens": max_completion_length,
            **dict(generation_kwargs or {}),
        }
        self.logprob_source = "sampled"
        """Which logprobs reach TRL's importance-sampling correction: ``"sampled"`` (SGLang's
        logprobs of the sampling distribution, after temperature), ``"rescored"`` (the model's own
        logprobs read back by a prefill-only request, because the sampling parameters change the
        distribution and the trainer compares the unprocessed model; docs/trl-conformance.md) or
        ``"none"`` (NaN: TRL then applies no correction to those tokens)."""
        if self.want_logprobs and rescoring_needed(self.sampling_params):
            if float(temperature) == 1.0:
                self.logprob_source = "rescored"
                log.info(
                    "sampling parameters %s change SGLang's distribution (grammar, logit_bias or penalties): "
                    "completions are rescored with the model's own logprobs for TRL's importance-sampling "
                    "correction (one prefill-only request per batch)",
                    _processing_keys(self.sampling_params),
                )
            else:
                self.logprob_source = "none"
                log.warning(
                    "sampling parameters %s change SGLang's distribution and temperature=%g != 1: SGLang "
                    "0.5.23 cannot return the model's own temperature-scaled logprobs, so TRL's importance-"
                    "sampling correction is off for these rollouts (ratio 1). Use temperature=1.0 to keep it",
                    _processing_keys(self.sampling_params),
                    temperature,
                )
        self.history: deque[GenerationRecord] = deque(maxlen=10_000)
        """One record per ``generate`` call on the main process (tests and debugging read it)."""
        self._metrics = _Metrics()
        self._synced_step: int | None = None
        self._endpoints: SGLangEndpoints | None = None
        self.waiter: ReplicaWaiter | None = None
        self.publisher: CheckpointPublisher | None = None
        self.adapters: AdapterPublisher | None = None
        """Set on the main process when LoRA adapter sync applies (adapter_publish.py)."""
        if accelerator.is_main_process:
            self._setup_main(model, args)

    # --- TRL's server-mode start-up check --------------------------------------------------
    @property
    def vllm_client(self) -> _ProcessedLogprobsServerInfo:
        """Stands in for TRL's ``VLLMClient`` in the one call TRL makes at start-up."""
        return _ProcessedLogprobsServerInfo()

    # --- the seam ---------------------------------------------------------------------------
    def sync_weights(self) -> None:
        """Publish the current policy as the next checkpoint version and wait for the replicas.

        Every process must call it (weights are gathered collectively). Raises on every process
        when the main process fails (write error, replicas not acknowledging in ``sync_timeout``).
        """
        step = self.current_step() if self.current_step is not None else None
        if step is not None and step == self._synced_step:
            return
        accelerator = self.accelerator
        if self.adapters is not None:  # the main process publishes the adapter alone
            self._sync_adapter(step)
            return
        tensors = iter_full_weights(self.model, accelerator)
        error: BaseException | None = None
        if accelerator.is_main_process:
            assert self.publisher is not None
            try:
                version = self.publisher.next_version()
                if self.max_staleness > 0 and self.publisher.first_version is not None:
                    gather_s = self.publisher.publish_in_background(version, tensors)
                    log.info(
                        "publishing version %d in the background (copy %.3f s); rollouts may use weights "
                        "up to %d version(s) old",
                        version,
                        gather_s,
                        self.max_staleness,
                    )
                else:
                    self.publisher.publish_and_wait(version, tensors)
            except Exception as exc:  # reported to every process below
                error = exc
        _drain(tensors)
        _raise_everywhere(accelerator, error, "sync_weights")
        self._synced_step = step

    def _sync_adapter(self, step: int | None) -> None:
        """Adapter sync: publish the LoRA adapter as the next version and wait (main process)."""
        assert self.adapters is not None
        error: BaseException | None = None
        try:
            self.adapters.publish_and_wait()
        except Exception as exc:  # reported to every process
            error = exc
        _raise_everywhere(self.accelerator, error, "sync_weights")
        self._synced_step = step

    def generate(
        self,
        prompts: list[list[int]],
        images: list[Any] | None,
        num_generations: int,
        profiler: Any = None,
    ) -> tuple[list[list[int]], list[list[int]], list[list[list[float | None]]] | None, list[list[list[int]]] | None]:
        """Generate ``num_generations`` completions per prompt group; see the module docstring."""
        profiler = profiler or nullcontext()
        accelerator = self.accelerator
        all_prompts = gather_object(prompts)
        # Gathered even when None: gather_object is collective and images may be None on some ranks only.
        all_images = gather_object(images if images is not None else [None] * len(prompts))
        payload: tuple[list[list[int]], list[list[float | None]] | None] | None = None
        error: BaseException | None = None
        if accelerator.is_main_process:
            try:
                if any(image is not None for image in all_images):
                    raise NotImplementedError(
                        "SGLangGeneration sends token ids only; prompts with images are not supported yet. "
                        "Use a text-only dataset, or TRL's vLLM backend for vision-language models"
                    )
                unique = _unique_prompts(all_prompts, num_generations)
                with profiler:
                    groups = self._generate_on_main(unique, num_generations)
                completions = [c for group in groups for c in group]
                payload = (
                    [c.token_ids for c in completions],
                    [c.logprobs for c in completions] if self.want_logprobs else None,  # type: ignore[misc]
                )
            except Exception as exc:  # reported to every process below
                error = exc
        _raise_everywhere(accelerator, error, "generate")
        if accelerator.num_processes > 1:
            box = [payload]
            broadcast_object_list(box, from_process=0)
            payload = box[0]
        assert payload is not None
        all_completion_ids, all_logprobs = payload
        start = accelerator.process_index * len(prompts)
        local = slice(start, start + len(prompts))
        completion_ids = all_completion_ids[local]
        if len(completion_ids) != len(prompts):
            raise RuntimeError(
                f"process {accelerator.process_index} expected {len(prompts)} completions, got {len(completion_ids)}: "
                "processes passed different numbers of prompts to generate()"
            )
        logprobs = logprob_token_ids = None
        if all_logprobs is not None:
            local_logprobs = all_logprobs[local]
            logprobs = [[[lp] for lp in seq] for seq in local_logprobs]
            logprob_token_ids = [[[t] for t in ids] for ids in completion_ids]
        return [list(p) for p in prompts], completion_ids, logprobs, logprob_token_ids

    # --- metrics ----------------------------------------------------------------------------
    def drain_metrics(self) -> dict[str, list[float]]:
        """Sync and generation metrics recorded since the last call (main process; empty elsewhere)."""
        if self.publisher is not None:
            for record in self.publisher.drain_records():
                self._metrics.add("sglang/sync_version", record.version)
                self._metrics.add("sglang/sync_gather_s", record.gather_s)
                self._metrics.add("sglang/sync_write_s", record.write_s)
                self._metrics.add("sglang/sync_wait_s", record.wait_s)
                self._metrics.add("sglang/sync_total_s", record.total_s)
                self._metrics.add("sglang/sync_mb", record.bytes / 1e6)
                self._metrics.add("sglang/sync_full_mb", record.full_bytes / 1e6)
                self._metrics.add("sglang/sync_delta", 1.0 if record.kind == "delta" else 0.0)
        values, self._metrics = self._metrics.values, _Metrics()
        return dict(values)

    def finish_pending_sync(self) -> None:
        """Wait for a background sync to finish; raise its error on every process."""
        error: BaseException | None = None
        if self.publisher is not None:
            try:
                self.publisher.join()
            except Exception as exc:  # reported to every process below
                error = exc
        _raise_everywhere(self.accelerator, error, "the last background sync")

    @property
    def endpoints(self) -> SGLangEndpoints | None:
        """The SGLang servers this process talks to (the main process's; None on the others)."""
        return self._endpoints

    def close(self) -> None:
        """Finish a background sync (raising its error), stop the publisher's worker thread and
        release the HTTP client and request threads. The trainer calls it when ``train()`` ends or
        fails; a later ``generate`` or ``sync_weights`` (``trainer.evaluate()``) opens them again."""
        try:
            if self.publisher is not None:
                self.publisher.close()
        finally:
            if self._endpoints is not None:
                self._endpoints.close()

    # --- main-process internals -----------------------------------------------------------
    def _setup_main(self, model: torch.nn.Module, args: SGLangRolloutArguments) -> None:
        base = unwrap_model(model)
        if is_peft(base):
            base = base.get_base_model()
        config = base.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab_size = getattr(text_config, "vocab_size", None)
        self._endpoints = SGLangEndpoints(
            args.sglang_urls,
            request_timeout_s=args.sglang_request_timeout,
            vocab_size=vocab_size,
            api_key=args.sglang_api_token,
            log_paths=getattr(args, "sglang_log_paths", None) or (),
            status_urls=args.sidecar_urls or (),
        )
        root = args.checkpoint_path
        assert root is not None  # the config refuses to be built without one
        if args.sidecar_urls:
            self.waiter = SidecarWaiter(args.sidecar_urls, token=args.sidecar_token)
        else:
            assert args.expected_replicas is not None
            self.waiter = AckFileWaiter(Path(root), args.expected_replicas, max_age_s=args.replica_heartbeat_max_age)
        warn_if_sharing_the_cpu(self._endpoints)
        dtype = _checkpoint_dtype(args.checkpoint_dtype, base)
        config_dict = json.loads(config.to_json_string())
        config_dict["dtype"] = dtype
        self.publisher = CheckpointPublisher(
            root,
            self.waiter,
            config=config_dict,
            dtype=dtype,
            max_shard_bytes=int(args.checkpoint_max_shard_mb * 1024 * 1024),
            keep=args.keep_checkpoints,
            sync_timeout_s=args.sync_timeout,
            heartbeat_max_age_s=args.replica_heartbeat_max_age,
            base_model=getattr(base, "name_or_path", None) or None,
            delta=delta_writer_for(args, dtype),
        )
        self.adapters = choose_adapter_sync(self.publisher, model, self.accelerator, args, dtype)

    def _required_version(self) -> int | None:
        """The oldest checkpoint version a completion may come from (None before the first sync)."""
        assert self.publisher is not None
        latest, first = self.publisher.latest_version, self.publisher.first_version
        if latest is None or first is None:
            return None
        return max(latest - self.max_staleness, first)

    def _generate_on_main(self, unique: list[list[int]], n: int) -> list[list[Completion]]:
        assert self._endpoints is not None and self.publisher is not None
        self.publisher.raise_if_failed()
        started = time.monotonic()
        deadline = started + self.sync_timeout
        params = dict(self.sampling_params, n=n)
        self._endpoints.forget_crashes()
        groups: list[list[Completion] | None] = [None] * len(unique)
        todo = list(range(len(unique)))
        retries = 0
        while True:
            adapter = self.adapters.current() if self.adapters is not None else None
            answers = self._endpoints.generate(
                [unique[i] for i in todo],
                params,
                want_logprobs=self.want_logprobs,
                deadline=deadline,
                rescore=self.logprob_source == "rescored",
                lora_path=None if adapter is None else adapter[1],
            )
            if adapter is not None:
                label_with_adapter(answers, *adapter)
            if self.logprob_source == "none":
                for group in answers:
                    for c in group:
                        c.logprobs = [None] * len(c.token_ids)
            required = self._required_version()
            retry: list[int] = []
            stale_versions: set[str] = set()
            aborted = 0
            for i, group in zip(todo, answers):
                groups[i] = group
                if any(c.finish_reason == "abort" for c in group):
                    aborted += 1
                    retry.append(i)
                elif required is not None and any(
                    c.weight_version is None or c.weight_version < required for c in group
                ):
                    stale_versions.update(c.raw_weight_version or "none" for c in group)
                    retry.append(i)
            if not retry:
                break
            if time.monotonic() >= deadline:
                if stale_versions:
                    raise StaleWeightsError(
                        f"SGLang kept answering {len(retry) - aborted} prompt(s) with weights of version(s) "
                        f"{sorted(stale_versions)}, but the trainer published version {self.publisher.latest_version} "
                        f"and max_staleness={self.max_staleness} requires version >= {required}; the replicas did "
                        f"not catch up within sync_timeout={self.sync_timeout:g} s. A replica behind the endpoints "
                        f"{self._endpoints.urls} is not loading checkpoints: check its sidecar (GET /status) and its "
                        "--checkpoint-path"
                    )
                raise RuntimeError(
                    f"SGLang kept aborting {aborted} prompt group(s) until sync_timeout={self.sync_timeout:g} s ran "
                    f"out; check the SGLang server logs behind {self._endpoints.urls}"
                )
            retries += 1
            if aborted:
                log.warning(
                    "SGLang aborted %d prompt group(s) (a restart or weight update cut them off); "
                    "generating them again (attempt %d)",
                    aborted,
                    retries,
                )
            if stale_versions:
                log.warning(
                    "%d prompt(s) answered with stale weights (versions %s, need >= %s); waiting for the "
                    "replicas and retrying (attempt %d)",
                    len(retry) - aborted,
                    sorted(stale_versions),
                    required,
                    retries,
                )
            self._wait_for_replicas(
                required if stale_versions else None, deadline, pause=min(STALE_RETRY_PAUSE_S * retries, 5.0)
            )
            todo = retry
        done = [g for g in groups if g is not None]
        versions = [c.weight_version for g in done for c in g]
        latest = self.publisher.latest_version
        known = [v for v in versions if v is not None]
        seconds = time.monotonic() - started
        self.history.append(
            GenerationRecord(
                published_version=latest,
                required_version=self._required_version(),
                versions=versions,
                stale_retries=retries,
                seconds=seconds,
            )
        )
        if latest is not None and known:
            self._metrics.add("sglang/version_lag", latest - min(known))
        self._metrics.add("sglang/stale_retries", retries)
        self._metrics.add("sglang/generate_s", seconds)
        return done

    def _wait_for_replicas(self, version: int | None, deadline: float, pause: float) -> None:
        assert self.waiter is not None
        remaining = deadline - time.monotonic()
        if version is not None and remaining > 0:
            try:
                self.waiter.wait(version, min(STALE_WAIT_SLICE_S, remaining))
            except ReplicaSyncTimeout:
                pass
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))


def _processing_keys(params: dict[str, Any]) -> list[str]:
    return sorted(
        k
        for k in (
            "regex",
            "json_schema",
            "ebnf",
            "structural_tag",
            "logit_bias",
            "min_new_tokens",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
        )
        if params.get(k) not in (None, 0, 0.0, {}) and not (k == "repetition_penalty" and params[k] == 1.0)
    )


def _unique_prompts(all_prompts: list[list[int]], num_generations: int) -> list[list[int]]:
    if num_generations < 1 or len(all_prompts) % num_generations:
        raise ValueError(
            f"generate() got {len(all_prompts)} prompts in total, not a multiple of num_generations="
            f"{num_generations}: TRL passes each prompt num_generations times in a row"
        )
    unique = all_prompts[::num_generations]
    for g, prompt in enumerate(unique):
        block = all_prompts[g * num_generations : (g + 1) * num_generations]
        if any(list(p) != list(prompt) for p in block):
            raise ValueError(
                f"prompt group {g} does not repeat one prompt {num_generations} times; generate() expects TRL's "
                "RepeatSampler layout (each prompt num_generations times in a row across processes)"
            )
    return [list(p) for p in unique]


def warn_if_sharing_the_cpu(endpoints: SGLangEndpoints) -> bool:
    """Warn (and return True) when a CPU-only trainer uses every core beside a local SGLang that
    busy-polls.

    SGLang's CPU scheduler keeps a core busy even when idle unless it runs with
    ``--sleep-on-idle`` (``rollout-service serve`` and the launcher pass it on CPU); a trainer
    whose torch threads use every core then waits on its own descheduled threads (measured on
    2 cores: TRL's step 0.34 s -> 6.5 s with an idle busy-polling server beside it).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if torch.cuda.is_available() or torch.get_num_threads() < cores:
        return False
    polling = [u for u in endpoints.urls if is_loopback_url(u) and endpoints.sleeps_on_idle(u) is not True]
    if not polling:
        return False
    log.warning(
        "SGLang at %s runs on this machine's CPU, may busy-poll a core while idle, and the trainer uses "
        "all %d cores: training can slow down many times over. Start SGLang with --sleep-on-idle (as "
        "`rollout-service serve` does on CPU) or call torch.set_num_threads(%d) before training",
        ", ".join(polling),
        cores,
        max(1, cores // 2),
    )
    return True


def delta_writer_for(args: Any, dtype: str) -> DeltaCheckpointWriter | None:
    """The delta writer ``checkpoint_delta`` asks for; by default (None) one for 16-bit checkpoints,
    whose unchanged weights are most of the model at RL learning rates (fp32's low bits change at
    nearly every step, so its deltas barely compress)."""
    wanted = getattr(args, "checkpoint_delta", None)
    if wanted is None:
        wanted = normalize_dtype(dtype) in ("BF16", "F16")
    if not wanted:
        return None
    return DeltaCheckpointWriter(
        full_every=getattr(args, "checkpoint_full_every", DEFAULT_FULL_EVERY),
        max_ratio=getattr(args, "checkpoint_delta_max_ratio", DEFAULT_DELTA_MAX_RATIO),
    )


def _checkpoint_dtype(requested: str | None, model: torch.nn.Module) -> str:
    """The dtype name checkpoints are written in: the requested one, else the model's configured one."""
    if requested is not None:
        return _DTYPE_NAMES[normalize_dtype(requested)]  # type: ignore[index]
    configured = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if isinstance(configured, torch.dtype):
        configured = str(configured).removeprefix("torch.")
    if isinstance(configured, str) and configured not in ("auto", ""):
        try:
            return _DTYPE_NAMES[normalize_dtype(configured)]  # type: ignore[index]
        except (KeyError, ValueError):
            pass
    for param in model.parameters():
        if param.is_floating_point():
            return str(param.dtype).removeprefix("torch.")
    return "float32"


def _drain(iterator: Any) -> None:
    for _ in iterator:
        pass


def _raise_everywhere(accelerator: Any, error: BaseException | None, where: str) -> None:
    """Raise ``error`` (found on the main process) on every process; a no-op when there is none."""
    if accelerator.num_processes > 1:
        box = [None if error is None else f"{type(error).__name__}: {error}"]
        broadcast_object_list(box, from_process=0)
        if box[0] is not None and error is None:
            raise RuntimeError(f"{where} failed on the main process: {box[0]}")
    if error is not None:
        raise error
