"""SGLang as TRL's generation backend: the two calls a TRL trainer makes, and nothing else.

TRL's GRPO and RLOO trainers talk to their generation backend through exactly two methods
(see ``trl/generation/vllm_generation.py``), which :class:`SGLangGeneration` implements:

``sync_weights()``
    Called when ``trainer.state.global_step`` changed since the last sync (TRL keeps
    ``_last_loaded_step``; this class checks again). Every process gathers the full weights
    (collective under FSDP / ZeRO-3); the main process publishes them as the next checkpoint
    version under ``checkpoint_path`` and waits until every expected replica serves it. With
    ``max_staleness > 0`` the write and the wait run in a background thread (after the first
    version, which is always waited for, and except within :meth:`SGLangGeneration.syncing_in_foreground`,
    which evaluation uses: it generates with the newest weights).

``generate(prompts, images, num_generations, profiler)``
    ``prompts`` are this process's prompt token ids, each repeated ``num_generations`` times in a
    row. They are gathered from all processes, de-duplicated with ``[::num_generations]``, sent
    to SGLang as one batch per endpoint with ``n=num_generations``, checked (integer token ids,
    weight version within ``max_staleness`` of the newest checkpoint, else retried after waiting
    for the replica: :mod:`trainer_hooks.stale_retry`) and scattered back, each process getting
    the completions of its own prompts: processes may pass different numbers of prompts (TRL's
    tool loop passes only the samples that called a tool). Every process must call it, as with
    TRL's vLLM server backend: a process that skips a call (TRL's tool loop on a process where no
    sample called a tool) leaves the others waiting in the gather (docs/trl-conformance.md). Returns
    ``(prompt_ids, completion_ids, logprobs, logprob_token_ids)``: lists per completion, logprobs
    shaped ``[[lp], ...]`` per token (the sampled token's logprob after temperature scaling, which
    is what TRL's importance sampling needs; when the sampling parameters change the
    distribution, e.g. a grammar, the model's own logprob read back from SGLang instead, see
    ``logprob_source``), ``logprob_token_ids`` likewise ``[[token_id], ...]``.

Errors on the main process (SGLang down, replicas lagging past ``sync_timeout``) are broadcast
to every process, so all of them raise instead of some waiting forever in a collective.

The parts behind the seam live beside it: the main process's wiring (endpoints, replica waiter,
checkpoint publisher, adapter sync) in :mod:`trainer_hooks.trainer`, the staleness bound and its
retries in :mod:`trainer_hooks.stale_retry`, the logged metrics in :mod:`trainer_hooks.rollout_metrics`.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from typing import Any

import torch
from accelerate.utils import broadcast_object_list, gather_object

from .adapter_publish import AdapterPublisher
from .checkpoint_publisher import CheckpointPublisher
from .config import distribution_changing_keys, greedy, rescoring_needed, sglang_sampling_params
from .rollout_metrics import RolloutMetrics
from .sglang_endpoints import SGLangEndpoints
from .stale_retry import GenerationRecord, StaleRetryPolicy
from .weight_gather import iter_full_weights

log = logging.getLogger(__name__)


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

    Built by :func:`trainer_hooks.trainer.build_sglang_generation`, which wires the main
    process's parts from the trainer's config; the other processes get none and only take part in
    the collectives (gathers and broadcasts).

    Arguments:
        model: the policy being trained (plain, DDP, FSDP2, DeepSpeed or PEFT model).
        accelerator: the trainer's ``accelerate.Accelerator``.
        processing_class: the trainer's tokenizer or processor (unused: prompts arrive as ids).

        > Main process (None on the others)

        publisher: publishes the gathered weights as checkpoint versions and waits for the replicas.
        rollouts: sends the prompts to SGLang and retries aborted and stale answers.
        adapters: with LoRA adapter sync, publishes the adapter instead of the merged weights.

        > Sampling (as TRL passes them to its vLLM backend)

        temperature, top_p, top_k, min_p, repetition_penalty: sampling parameters (``top_k``
            0 or None and ``min_p`` None mean disabled).
        max_completion_length: SGLang's ``max_new_tokens``.
        logprobs: 0 to return the sampled token's logprob (GRPO), None for none (RLOO).
        logprobs_used: whether TRL reads those logprobs (``config.engine_logprobs_used``); when
            not, they are SGLang's own and never rescored.
        generation_kwargs: extra SGLang sampling parameters, by SGLang's names; they override
            the ones above.
        structured_outputs_regex: TRL's ``vllm_structured_outputs_regex``, sent as SGLang's
            ``regex`` (it replaces a grammar in ``generation_kwargs``; see
            :func:`~trainer_hooks.config.sglang_sampling_params`, which builds the parameters).

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
        publisher: CheckpointPublisher | None = None,
        rollouts: StaleRetryPolicy | None = None,
        adapters: AdapterPublisher | None = None,
        syncs_adapters: bool | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int | None = 0,
        min_p: float | None = 0.0,
        repetition_penalty: float = 1.0,
        max_completion_length: int = 16,
        logprobs: int | None = 0,
        generation_kwargs: dict[str, Any] | None = None,
        structured_outputs_regex: str | None = None,
        current_step: Callable[[], int] | None = None,
        logprobs_used: bool = True,
    ) -> None:
        if logprobs not in (None, 0):
            raise ValueError(
                f"logprobs={logprobs} asks for top-{logprobs} logprobs per token; SGLangGeneration returns the "
                "sampled token's logprob only (logprobs=0) or none (logprobs=None)"
            )
        if accelerator.is_main_process and (publisher is None or rollouts is None):
            raise ValueError(
                "SGLangGeneration on the main process needs its publisher and rollouts; build it with "
                "trainer_hooks.build_sglang_generation(...)"
            )
        self.model = model
        self.model_source: Callable[[], Any] | None = None
        """The trainer's current model, set by the trainer after TRL built this backend: ``model``
        is the one TRL had before ``accelerator.prepare`` wrapped it, which under FSDP1 is the
        module inside the root FSDP unit, whose flat parameter holds the weights no inner unit owns
        (embeddings, final norm, head): gathered from there, they were missing."""
        self.accelerator = accelerator
        self.processing_class = processing_class
        self.publisher = publisher
        self.rollouts = rollouts
        self.adapters = adapters
        """Set on the main process when LoRA adapter sync applies (adapter_publish.py)."""
        self.syncs_adapters = adapters is not None if syncs_adapters is None else syncs_adapters
        """On every process: whether the main process syncs the adapter (then no process merges
        the adapter into its base weights at a sync; see :func:`~trainer_hooks.trainer.build_sglang_generation`)."""
        if self.syncs_adapters is False and adapters is not None:
            raise ValueError("syncs_adapters=False contradicts the adapter publisher handed over")
        self.want_logprobs = logprobs is not None
        self.current_step = current_step
        self.sampling_params: dict[str, Any] = sglang_sampling_params(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            max_completion_length=max_completion_length,
            generation_kwargs=generation_kwargs,
            structured_outputs_regex=structured_outputs_regex,
        )
        # Logprobs TRL asks for but drops (the correction off: config.engine_logprobs_used) are
        # SGLang's own: no rescore to pay for.
        self.logprob_source = _logprob_source(self.sampling_params, temperature, self.want_logprobs and logprobs_used)
        """Which logprobs reach TRL's importance-sampling correction: ``"sampled"`` (SGLang's
        logprobs of the sampling distribution, after temperature), ``"rescored"`` (the model's own
        logprobs read back by a prefill-only request, because the sampling parameters change the
        distribution and the trainer compares the unprocessed model; docs/trl-conformance.md) or
        ``"none"`` (NaN: TRL then applies no correction to those tokens; when neither of the others
        is the trainer's temperature-scaled distribution)."""
        self.history: deque[GenerationRecord] = deque(maxlen=10_000)
        """One record per ``generate`` call on the main process (tests and debugging read it)."""
        self.metrics = RolloutMetrics()
        self._synced_step: int | None = None
        self._foreground = False
        """Within :meth:`syncing_in_foreground`: every sync waits for the replicas before it returns."""

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
        With ``max_staleness > 0`` the write and the wait run in the background, except within
        :meth:`syncing_in_foreground`.
        """
        step = self.current_step() if self.current_step is not None else None
        if step is not None and step == self._synced_step:
            return
        accelerator = self.accelerator
        if self.syncs_adapters:  # the main process publishes the adapter alone
            self._sync_adapter(step)
            return
        tensors = iter_full_weights(self.model_source() if self.model_source is not None else self.model, accelerator)
        error: BaseException | None = None
        if accelerator.is_main_process:
            assert self.publisher is not None and self.rollouts is not None
            try:
                version = self.publisher.next_version()
                if self.rollouts.publishes_in_background() and not self._foreground:
                    gather_s = self.publisher.publish_in_background(version, tensors)
                    log.info(
                        "publishing version %d in the background (copy %.3f s); rollouts may use weights "
                        "up to %d version(s) old",
                        version,
                        gather_s,
                        self.rollouts.max_staleness,
                    )
                else:
                    self.publisher.publish_and_wait(version, tensors)
            except Exception as exc:  # reported to every process below
                error = exc
        _drain(tensors)
        raise_everywhere(accelerator, error, "sync_weights")
        self._synced_step = step

    def _sync_adapter(self, step: int | None) -> None:
        """Adapter sync: the main process publishes the LoRA adapter as the next version and waits;
        the others only learn how it went (their base weights are left alone: merging the adapter
        in and out would round them away from the main process's, and DDP never syncs frozen ones)."""
        error: BaseException | None = None
        if self.accelerator.is_main_process:
            assert self.adapters is not None
            try:
                self.adapters.publish_and_wait()
            except Exception as exc:  # reported to every process
                error = exc
        raise_everywhere(self.accelerator, error, "sync_weights")
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
        # One gather of (prompts, images) per process: the lengths say where each process's completions
        # start (TRL's tool loop passes different numbers of prompts per process). Images are gathered
        # even when None, as [None] * len(prompts), since they may be None on some processes only.
        gathered = gather_object([(list(prompts), list(images) if images is not None else [None] * len(prompts))])
        counts = [len(sent) for sent, _ in gathered]
        all_prompts = [p for sent, _ in gathered for p in sent]
        all_images = [image for _, sent_images in gathered for image in sent_images]
        payload: tuple[list[list[int]], list[list[float | None]] | None] | None = None
        error: BaseException | None = None
        if accelerator.is_main_process:
            assert self.rollouts is not None
            try:
                if any(image is not None for image in all_images):
                    raise NotImplementedError(
                        "SGLangGeneration sends token ids only; prompts with images are not supported yet. "
                        "Use a text-only dataset, or TRL's vLLM backend for vision-language models"
                    )
                unique = _unique_prompts(all_prompts, num_generations)
                with profiler:
                    groups, record = self.rollouts.generate(
                        unique,
                        dict(self.sampling_params, n=num_generations),
                        want_logprobs=self.want_logprobs,
                        rescore=self.logprob_source == "rescored",
                    )
                self.history.append(record)
                self.metrics.add_generation(record)
                completions = [c for group in groups for c in group]
                if len(completions) != len(all_prompts):  # checked here, so that every process raises it
                    raise RuntimeError(
                        f"generate() got {len(completions)} completions back for {len(all_prompts)} prompts "
                        f"(per process: {counts}, num_generations={num_generations}): the rollout answers do not "
                        "match the prompts sent"
                    )
                if self.logprob_source == "none":
                    for c in completions:
                        c.logprobs = [None] * len(c.token_ids)
                payload = (
                    [c.token_ids for c in completions],
                    [c.logprobs for c in completions] if self.want_logprobs else None,  # type: ignore[misc]
                )
            except Exception as exc:  # reported to every process below
                error = exc
        raise_everywhere(accelerator, error, "generate")
        if accelerator.num_processes > 1:
            box = [payload]
            broadcast_object_list(box, from_process=0)
            payload = box[0]
        assert payload is not None
        all_completion_ids, all_logprobs = payload
        start = sum(counts[: accelerator.process_index])  # the processes before this one, in gather order
        local = slice(start, start + len(prompts))
        completion_ids = all_completion_ids[local]
        logprobs = logprob_token_ids = None
        if all_logprobs is not None:
            local_logprobs = all_logprobs[local]
            logprobs = [[[lp] for lp in seq] for seq in local_logprobs]
            logprob_token_ids = [[[t] for t in ids] for ids in completion_ids]
        return [list(p) for p in prompts], completion_ids, logprobs, logprob_token_ids

    # --- around the seam: metrics, the last background sync, closing ------------------------
    def drain_metrics(self) -> dict[str, list[float]]:
        """Sync and generation metrics recorded since the last call (main process; empty elsewhere)."""
        if self.publisher is not None:
            self.metrics.add_syncs(self.publisher.drain_records())
        return self.metrics.drain()

    @contextlib.contextmanager
    def syncing_in_foreground(self) -> Iterator[None]:
        """Within it, every sync publishes and waits for the replicas before it returns, also with
        ``max_staleness > 0``; a background sync still in flight is finished first (its error raised
        on every process). Evaluation runs within it (:meth:`~trainer_hooks.trainer.GRPOTrainer.evaluate`):
        its rollouts come from the newest weights, not from up to ``max_staleness`` versions before
        them, and it leaves no sync running behind it. Every process must enter it."""
        self.finish_pending_sync()
        self._foreground = True
        if self.rollouts is not None:
            self.rollouts.newest_only = True  # (a replica not waited for may serve an older version)
        try:
            yield
        finally:
            self._foreground = False
            if self.rollouts is not None:
                self.rollouts.newest_only = False

    def finish_pending_sync(self) -> None:
        """Wait for a background sync to finish; raise its error on every process."""
        error: BaseException | None = None
        if self.publisher is not None:
            try:
                self.publisher.join()
            except Exception as exc:  # reported to every process below
                error = exc
        raise_everywhere(self.accelerator, error, "the last background sync")

    @property
    def endpoints(self) -> SGLangEndpoints | None:
        """The SGLang servers this process talks to (the main process's; None on the others)."""
        return self.rollouts.endpoints if self.rollouts is not None else None

    def close(self) -> None:
        """Finish a background sync (raising its error), stop the publisher's worker thread and
        release the HTTP client and request threads. The trainer calls it when ``train()`` ends or
        fails; a later ``generate`` or ``sync_weights`` (``trainer.evaluate()``) opens them again."""
        try:
            if self.publisher is not None:
                self.publisher.close()
        finally:
            if self.rollouts is not None:
                self.rollouts.endpoints.close()


def _logprob_source(params: dict[str, Any], temperature: float, want_logprobs: bool) -> str:
    """What ``SGLangGeneration.logprob_source`` documents, decided from the sampling parameters and
    the trainer's ``temperature`` (the one TRL scales its own logprobs with)."""
    if not want_logprobs:
        return "sampled"
    if greedy(params) and float(temperature) != 1.0:
        log.warning(
            "greedy decoding (top_k=1, do_sample=False or temperature 0 in generation_kwargs) with temperature=%g "
            "!= 1: SGLang 0.5.23 returns the logprobs of a greedy batch without temperature scaling (and with it "
            "when the batch mixes in other requests), and a rescore is at temperature 1 too, so neither is the "
            "trainer's temperature-scaled logprob: TRL's importance-sampling correction is off for these rollouts "
            "(ratio 1). Use temperature=1.0 to keep it",
            temperature,
        )
        return "none"
    if not rescoring_needed(params):
        return "sampled"
    if float(temperature) == 1.0:
        log.info(
            "sampling parameters %s change SGLang's distribution (grammar, logit_bias or penalties): "
            "completions are rescored with the model's own logprobs for TRL's importance-sampling "
            "correction (one prefill-only request per batch)",
            distribution_changing_keys(params),
        )
        return "rescored"
    log.warning(
        "sampling parameters %s change SGLang's distribution and temperature=%g != 1: SGLang "
        "0.5.23 cannot return the model's own temperature-scaled logprobs, so TRL's importance-"
        "sampling correction is off for these rollouts (ratio 1). Use temperature=1.0 to keep it",
        distribution_changing_keys(params),
        temperature,
    )
    return "none"


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


def _drain(iterator: Any) -> None:
    """Exhaust the weights iterator, whatever the writer took of it. Never close it instead:
    under FSDP1 and ZeRO-3 each unit or parameter drawn is a collective gather that every
    process must take part in, in the same order; a main process that stopped early would
    leave the others waiting in one."""
    for _ in iterator:
        pass


def raise_everywhere(accelerator: Any, error: BaseException | None, where: str) -> None:
    """Raise ``error`` (found on the main process) on every process; a no-op when there is none."""
    if accelerator.num_processes > 1:
        box = [None if error is None else f"{type(error).__name__}: {error}"]
        broadcast_object_list(box, from_process=0)
        if box[0] is not None and error is None:
            raise RuntimeError(f"{where} failed on the main process: {box[0]}")
    if error is not None:
        raise error
