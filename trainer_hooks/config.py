"""Training arguments for GRPO with SGLang rollout servers synced through a checkpoint root.

:class:`GRPOConfig` is TRL's ``GRPOConfig`` plus the fields that say where checkpoints go
(``checkpoint_path``), which SGLang servers generate (``sglang_urls``) and how the trainer
learns that every replica loaded a checkpoint (``sidecar_urls`` or ``expected_replicas``).
Everything is checked in ``__post_init__``, so a wrong path or a missing endpoint fails when
the arguments are built, not after the first training step.

TRL's own fields either work as with TRL's own generation, are adapted here with one log line, or
are refused with the fix named (:func:`adapt_trl_fields`; the table is docs/trl-conformance.md).
TRL's own fields keep their meaning. ``use_vllm`` is TRL's switch for "generate with an external
engine" and gates its importance-sampling correction (``vllm_importance_sampling_*``), so it is
True here and must stay True; ``vllm_mode`` must stay ``"server"`` (the engine runs outside the
trainer). The other ``vllm_*`` settings (server host/port, colocate memory) are not used.
"""

from __future__ import annotations

import logging
import math
import os
import stat
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import trl

from rollout_service.checkpoint_format import (
    DEFAULT_DELTA_MAX_RATIO,
    DEFAULT_FULL_EVERY,
    MAX_CHAIN_LENGTH,
)
from rollout_service.cli_env import SHARD_MB_RANGE, TIMEOUT_S, check_range
from rollout_service.http_auth import check_token
from rollout_service.http_urls import check_http_url
from rollout_service.protocol import ACK_EXPIRY_S, ACK_INTERVAL_S, MIN_HEARTBEAT_MAX_AGE_S
from rollout_service.sidecar.root_gate import answered_within
from rollout_service.user_paths import setting_path

from .checkpoint_dtype import publishable_dtype
from .checkpoint_publisher import background_sync_bound_s
from .sampling_checks import check_sampling_values
from .sglang_endpoints import requests_per_round

log = logging.getLogger(__name__)

DEFAULT_SYNC_TIMEOUT_S = 600.0
DEFAULT_REQUEST_TIMEOUT_S = 1800.0
NUMBER_RANGES: dict[str, tuple[float, float, str]] = {
    "sync_timeout": (*TIMEOUT_S, "seconds"),
    "sglang_request_timeout": (*TIMEOUT_S, "seconds"),
    "replica_heartbeat_max_age": (MIN_HEARTBEAT_MAX_AGE_S, ACK_EXPIRY_S, "seconds"),
    "checkpoint_max_shard_mb": (*SHARD_MB_RANGE, "MiB"),
}
"""The number fields of :class:`SGLangRolloutArguments` with their ``(low, high, unit)``: every
seconds-valued one shares the CLI's ``TIMEOUT_S`` (rollout_service/cli_env.py), the heartbeat's
from ``MIN_HEARTBEAT_MAX_AGE_S`` to ``ACK_EXPIRY_S`` (rollout_service/protocol.py: an ack older
than that is removed, so a replica counted live past it would lose its retention protection)."""


@dataclass
class SGLangRolloutArguments:
    """The rollout-side fields shared by the SGLang-backed trainer configs.

    Arguments:
        checkpoint_path: shared directory the trainer publishes ``step-XXXXXXXX`` checkpoints
            into and the SGLang sidecars watch. Must exist and be writable by the trainer.
        sglang_urls: SGLang endpoints to generate with: one server, several (the batch of prompts
            is split between them; a dead one is skipped while others answer), or one router URL.
        sidecar_urls: sidecars whose ``GET /wait`` must confirm each checkpoint before the trainer
            generates with it. Use this or ``expected_replicas``.
        expected_replicas: wait until this many live replicas acknowledge each checkpoint through
            their ack files (``<checkpoint_path>/acks/*.json``) instead of asking sidecars.
        sync_timeout: seconds to wait for replicas to load a checkpoint, for a stale replica to
            catch up, or for an unreachable SGLang to come back, before failing with an error.
        max_staleness: how many checkpoint versions older than the newest published one a
            completion's weights may be. 0: every rollout uses the newest weights (publish and
            wait before generating). k > 0: publishing and waiting run in a background thread
            while rollouts continue on weights at most k versions old, which GRPO's
            importance-sampling correction weighs back (a warning when nothing does: RLOO, the
            correction off, or NaN logprobs; :func:`uncorrected_staleness`).
        checkpoint_dtype: floating dtype of published checkpoints ("bfloat16", "float16",
            "float32"); default: the model's configured dtype (what SGLang serves), or the one
            narrower dtype all its floating parameters hold when it was cast after loading.
        checkpoint_max_shard_mb: largest safetensors shard written, in MiB (times 2**20 bytes).
        checkpoint_delta: publish XOR+zstd deltas against the previous version instead of the
            whole model (the sidecars rebuild the full checkpoint in their node-local stage).
            None (default): for bfloat16/float16 checkpoints, a delta or a full checkpoint,
            whichever measures faster per GB on this storage (deltas win on network file
            systems, full checkpoints on tmpfs; ``rollout_service/delta_choice.py``); off for
            float32 (whose low bits change at every step, so deltas barely compress). True: a
            delta whenever one is possible. Costs one model copy in host RAM (the bytes of the
            last published version).
        checkpoint_full_every: with deltas, publish a full checkpoint every this many versions
            (late joiners and restarted sidecars replay at most this many deltas). With the
            default ``checkpoint_delta=None``, also how often a delta is tried again while full
            checkpoints measure faster.
        checkpoint_delta_max_ratio: publish a full checkpoint instead of a delta whose bytes
            exceed this fraction of the full checkpoint's.
        adapter_sync: with a PEFT LoRA model, publish only the adapter (``kind: "adapter"``) and
            have the replicas serve it with SGLang's LoRA support (``rollout-service serve
            --lora``), instead of merging it and publishing the whole model. When a replica
            cannot serve the adapter (no ``--lora``, DoRA, ``modules_to_save``, a rank or module
            outside its limits, a sharded model) the trainer syncs merged full checkpoints and
            logs why, once. False: always merged.
        keep_checkpoints: how many newest checkpoints to keep; older ones are deleted unless a
            live replica still serves or loads them. None keeps everything.
        sidecar_token: bearer token of the sidecars' ``POST /sync`` (when they were given one).
        sglang_request_timeout: seconds one ``POST /generate`` may take before its endpoint
            counts as failed.
        replica_heartbeat_max_age: seconds after which an ack file's heartbeat counts as dead
            (sidecars refresh it every 5 seconds, so at least 15: three missed writes); one the
            trainer sees move on counts as live although its host's clock runs behind (by up to
            ``MAX_CLOCK_SKEW_S``, 300 s, more).
        sglang_log_paths: SGLang's log files, readable by the trainer (same machine or shared
            storage), one per ``sglang_urls`` entry or a single one for all. When a request kills
            a server twice, the step's error quotes SGLang's last error lines from them (and the
            sidecars' ``/status`` ``last_error`` when ``sidecar_urls`` are set).
    """

    checkpoint_path: str | None = field(
        default=None,
        metadata={
            "help": "Shared directory the trainer publishes checkpoints into, one step-NNNNNNNN "
            "directory per version (e.g. step-00000042; the directory the SGLang sidecars watch)."
        },
    )
    sglang_urls: list[str] = field(
        default_factory=list,
        metadata={"help": "SGLang endpoints to generate with: one server, several, or a router URL."},
    )
    sidecar_urls: list[str] = field(
        default_factory=list,
        metadata={"help": "Sidecars whose GET /wait confirms each checkpoint (or use expected_replicas)."},
    )
    expected_replicas: int | None = field(
        default=None,
        metadata={"help": "Wait for this many replicas' ack files instead of sidecar_urls."},
    )
    sync_timeout: float = field(
        default=DEFAULT_SYNC_TIMEOUT_S,
        metadata={"help": "Seconds to wait for replicas to load a checkpoint before failing."},
    )
    max_staleness: int = field(
        default=0,
        metadata={
            "help": "Versions a rollout's weights may lag the newest checkpoint (0: none; "
            ">0: publish in the background)."
        },
    )
    checkpoint_dtype: str | None = field(
        default=None,
        metadata={
            "help": "dtype of published checkpoints (default: the model's configured dtype, or the"
            " narrower one all its floating parameters hold when it was cast after loading)."
        },
    )
    checkpoint_max_shard_mb: float = field(
        default=2048.0,
        metadata={"help": "Largest safetensors shard written, in MiB."},
    )
    checkpoint_delta: bool | None = field(
        default=None,
        metadata={
            "help": "Publish XOR+zstd deltas instead of whole checkpoints (default: for bf16/fp16 "
            "checkpoints, whichever of delta and full measures faster on this storage; off for fp32; "
            "True: always deltas). Keeps one model copy in host RAM."
        },
    )
    checkpoint_full_every: int = field(
        default=DEFAULT_FULL_EVERY,
        metadata={"help": "With deltas: a full checkpoint every this many versions (bounds a late joiner's replay)."},
    )
    checkpoint_delta_max_ratio: float = field(
        default=DEFAULT_DELTA_MAX_RATIO,
        metadata={"help": "With deltas: publish a full checkpoint when a delta would exceed this fraction of it."},
    )
    adapter_sync: bool = field(
        default=True,
        metadata={
            "help": "With a PEFT LoRA model, sync only the adapter when every replica serves LoRA "
            "(serve --lora); otherwise merged full checkpoints, with one log line saying why."
        },
    )
    keep_checkpoints: int | None = field(
        default=3,
        metadata={
            "help": "Newest checkpoints to keep (None: keep all); a version a live replica "
            "serves or loads is never deleted."
        },
    )
    sidecar_token: str | None = field(
        default=None,
        metadata={"help": "Bearer token of the sidecars' POST /sync."},
    )
    sglang_api_token: str | None = field(
        default=None,
        metadata={
            "help": "The --api-key SGLang was started with, sent as a Bearer token with every request "
            "(named *_token so that TrainingArguments redacts it in logs)."
        },
    )
    sglang_request_timeout: float = field(
        default=DEFAULT_REQUEST_TIMEOUT_S,
        metadata={"help": "Seconds one POST /generate may take before its endpoint counts as failed."},
    )
    replica_heartbeat_max_age: float = field(
        default=60.0,
        metadata={
            "help": "Seconds after which an ack file's heartbeat counts as dead (at least"
            f" {MIN_HEARTBEAT_MAX_AGE_S:g}: three of the sidecars' {ACK_INTERVAL_S:g} s ack writes)."
        },
    )
    sglang_log_paths: list[str] = field(
        default_factory=list,
        metadata={
            "help": "SGLang's log files as the trainer sees them (the --sglang-log of `rollout-service serve`), "
            "one per sglang_urls entry or one for all: when a request kills a server, the trainer's error "
            "quotes SGLang's last error lines from there."
        },
    )

    # TRL's own switches, fixed for SGLang (and checked below).
    use_vllm: bool = field(
        default=True,
        metadata={"help": "Generate with the external engine (SGLang here); must stay True."},
    )
    vllm_mode: str = field(
        default="server",
        metadata={"help": "Must stay 'server': SGLang runs outside the trainer."},
    )

    def __post_init__(self) -> None:
        """The one body of every SGLang-backed TRL config: adapt TRL's fields, let TRL check its
        own, then check ours (a mixin: ``super()`` is the TRL config it is combined with)."""
        self._check_rollout_values()  # first: adapt_trl_fields computes with the timeouts
        adapt_trl_fields(self, world_size=_world_size())
        super().__post_init__()  # type: ignore[misc]
        self._validate_rollout_arguments(is_main_process=self.process_index == 0)  # type: ignore[attr-defined]

    def _check_rollout_values(self) -> None:
        """Each number field in its range (:data:`NUMBER_RANGES`), each switch a real bool, the
        checkpoint dtype one that can be published; a ValueError names the field, value and range."""
        for name, (low, high, unit) in NUMBER_RANGES.items():
            _require_number(getattr(self, name), name, low, high, unit)
        for f in fields(SGLangRolloutArguments):
            if f.type in ("bool", "bool | None"):
                _require_bool(getattr(self, f.name), f.name, optional=f.type != "bool")
        ratio = self.checkpoint_delta_max_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(
                f"checkpoint_delta_max_ratio must be a number in (0, 1] (the largest delta, as a fraction of "
                f"the full checkpoint's bytes), got {ratio!r}"
            )
        if self.checkpoint_dtype is not None:
            publishable_dtype(self.checkpoint_dtype)

    def _validate_rollout_arguments(self, *, is_main_process: bool) -> None:
        """Check and normalize the SGLang fields; raise ValueError saying what to change."""
        if not self.use_vllm:
            raise ValueError(
                "use_vllm=False was passed to trainer_hooks' config, which generates with SGLang: TRL's "
                "use_vllm switch means 'generate with an external engine' here and gates the importance-"
                "sampling correction, so it must stay True. For in-process generation use trl's own config."
            )
        if self.vllm_mode != "server":
            raise ValueError(
                f"vllm_mode={self.vllm_mode!r} was passed, but SGLang runs outside the trainer: "
                "use vllm_mode='server' (the default of trainer_hooks' config)."
            )
        self.sglang_urls = _normalize_urls(self.sglang_urls, "sglang_urls")
        given: Any = self.sglang_log_paths  # (typed list[str]; a user may pass one path, or a Path)
        if isinstance(given, (str, os.PathLike)):
            given = [given]
        elif given is not None and not isinstance(given, (list, tuple)):
            raise ValueError(
                f"sglang_log_paths must be a path or a list of paths (one per sglang_urls entry), got"
                f" {type(given).__name__}"
            )
        self.sglang_log_paths = [_check_log_path(p) for p in (given or [])]
        if self.sglang_log_paths and len(self.sglang_log_paths) not in (1, len(self.sglang_urls)):
            raise ValueError(
                f"sglang_log_paths has {len(self.sglang_log_paths)} entries for {len(self.sglang_urls)} sglang_urls: "
                "give "
                "one log path per URL, in the same order, or a single one for all"
            )
        self.sidecar_urls = _normalize_urls(self.sidecar_urls, "sidecar_urls")
        check_token(self.sidecar_token, "sidecar_token")
        check_token(self.sglang_api_token, "sglang_api_token")
        if not self.sglang_urls:
            raise ValueError(
                "no SGLang endpoint: set sglang_urls to one server, several servers or a router URL, "
                "e.g. sglang_urls=['http://127.0.0.1:30000']"
            )
        both = sorted(set(self.sglang_urls) & set(self.sidecar_urls))
        if both:  # (a server answering both, such as a test's stand-in, is not refused)
            log.warning(
                "%s is in both sglang_urls and sidecar_urls: SGLang's endpoint is not its sidecar's"
                " (`rollout-service serve` puts SGLang on --port, 30000, and the sidecar on --sidecar-port,"
                " 8100); unless that server answers both, every sync will wait out sync_timeout",
                both[0],
            )
        if self.sidecar_token is not None and not self.sidecar_urls:
            log.warning(
                "sidecar_token is set but unused: the trainer sends it only to sidecar_urls, and waits on ack"
                " files here (expected_replicas)"
            )
        if self.sidecar_urls and self.expected_replicas is not None:
            raise ValueError(
                f"both sidecar_urls ({len(self.sidecar_urls)}) and expected_replicas "
                f"({self.expected_replicas}) are set: wait on the sidecars' /wait (sidecar_urls) or on "
                "ack files (expected_replicas), not both"
            )
        if not self.sidecar_urls and self.expected_replicas is None:
            raise ValueError(
                "nothing tells the trainer when replicas loaded a checkpoint: set sidecar_urls (e.g. "
                "['http://127.0.0.1:8100']) or expected_replicas (the number of replicas whose ack files "
                "appear under <checkpoint_path>/acks)"
            )
        if self.expected_replicas is not None:
            _require_int(self.expected_replicas, "expected_replicas", 1)
        _require_int(self.max_staleness, "max_staleness", 0)
        if self.keep_checkpoints is not None:
            _require_int(self.keep_checkpoints, "keep_checkpoints", 1, " (or None to keep everything)")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ValueError(
                f"keep_checkpoints must be at least 1 (the newest checkpoint is what replicas load) or None "
                f"to keep everything, got {self.keep_checkpoints}"
            )
        if (
            isinstance(self.checkpoint_full_every, bool)
            or not isinstance(self.checkpoint_full_every, int)
            or not 1 <= self.checkpoint_full_every <= MAX_CHAIN_LENGTH + 1
        ):
            raise ValueError(
                f"checkpoint_full_every must be an integer from 1 (every checkpoint is full) to"
                f" {MAX_CHAIN_LENGTH + 1} (the longest delta chain a sidecar replays), got"
                f" {self.checkpoint_full_every!r}"
            )
        if self.checkpoint_path is None or str(self.checkpoint_path).strip() == "":
            raise ValueError(
                "checkpoint_path is required: the shared directory the trainer publishes checkpoints into "
                "and the SGLang sidecars watch (the --checkpoint-path of `rollout-service serve`)"
            )
        self.checkpoint_path = os.fspath(setting_path(self.checkpoint_path, "checkpoint_path"))
        if is_main_process:
            path, bound = Path(self.checkpoint_path), self.sync_timeout
            answered, _ = answered_within(lambda: check_checkpoint_dir(path), bound, f"checking {path}")
            if not answered:  # a hung network file system: a read there blocks in the kernel for good
                raise ValueError(
                    f"checkpoint_path {path} did not answer within sync_timeout={bound:g} s: is its network"
                    f" file system hung (does `ls {path}` return)? Fix the mount, or raise sync_timeout if it"
                    " is only slow"
                )


def check_checkpoint_dir(path: Path) -> None:
    """Raise ValueError unless ``path`` is an existing directory this process can write to.

    Writes and removes a hidden probe file, because permission bits alone lie (root, ACLs,
    read-only mounts).
    """
    if not path.exists():
        raise ValueError(
            f"checkpoint_path {path} does not exist; create it or mount the shared checkpoint volume there "
            "(the SGLang sidecars must see the same directory)"
        )
    if not path.is_dir():
        raise ValueError(f"checkpoint_path {path} is not a directory; point it at the shared checkpoint directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".tmp-write-probe-", dir=path)
    except OSError as exc:
        raise ValueError(
            f"checkpoint_path {path} is not writable by this process ({exc.strerror or exc}); the trainer "
            "publishes checkpoints there: fix its permissions or mount it read-write"
        ) from exc
    os.close(fd)
    os.unlink(probe)


def _normalize_urls(urls: list[str] | str | None, name: str) -> list[str]:
    if urls is None:
        return []
    if isinstance(urls, str):
        urls = [u for u in urls.replace(",", " ").split()]
    out: list[str] = []
    for url in urls:
        url = check_http_url(url, f"{name} entry")
        if url not in out:
            out.append(url)
    return out


def _require_number(value: object, name: str, low: float, high: float, unit: str) -> None:
    """A finite int or float (not a bool, nor text) from ``low`` to ``high`` (the CLI's check)."""
    check_range(f"{name} (in {unit})", value, low, high)


def _require_bool(value: object, name: str, *, optional: bool) -> None:
    """True or False (or None when ``optional``): not a truthy string such as "false"."""
    if not (value is True or value is False or (optional and value is None)):
        allowed = "True, False or None (auto)" if optional else "True or False"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _check_log_path(path: object) -> str:
    """An ``sglang_log_paths`` entry, ``~`` expanded: refused when it exists and is not a regular file
    (a FIFO, a device, a directory: the trainer reads its tail when SGLang dies). A file that does
    not exist yet is fine: SGLang may create it later."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"sglang_log_paths entries must be file paths, got {path!r}")
    expanded = os.fspath(setting_path(path, "sglang_log_paths entry"))
    try:
        mode = os.stat(expanded).st_mode
    except OSError:
        return expanded  # missing (SGLang creates it) or unreadable (the error quotes why)
    if not stat.S_ISREG(mode):
        kind = (
            "a FIFO"
            if stat.S_ISFIFO(mode)
            else "a directory"
            if stat.S_ISDIR(mode)
            else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a special file (a socket)"
        )
        raise ValueError(
            f"sglang_log_paths entry {expanded!r} is {kind}, not a regular file: give SGLang's log file (the "
            "--sglang-log of `rollout-service serve`); a file that does not exist yet is fine"
        )
    return expanded


def _require_int(value: object, name: str, minimum: int, hint: str = "") -> None:
    """An integer (not a bool, nor a float that happens to be whole) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{hint}, got {value!r}")


@dataclass
class GRPOConfig(SGLangRolloutArguments, trl.GRPOConfig):
    """TRL's GRPOConfig for training with SGLang rollout servers (see :class:`SGLangRolloutArguments`)."""


@dataclass
class RLOOConfig(SGLangRolloutArguments, trl.RLOOConfig):
    """TRL's RLOOConfig for training with SGLang rollout servers (see :class:`SGLangRolloutArguments`)."""


# --- TRL fields with SGLang rollouts (docs/trl-conformance.md has the table) -----------------

SGLANG_SAMPLING_PARAMS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "custom_params",
        "watermark",
    }
)
"""The request-level sampling parameters of SGLang 0.5.23's ``/generate`` (``SamplingParams``) that
``generation_kwargs`` may carry; ``n``, ``beam_width`` and ``sampling_seed`` are not among them (see below)."""

CONSTRAINT_PARAMS = ("regex", "json_schema", "ebnf", "structural_tag")

_RENAMED = {  # transformers / vLLM name -> SGLang name, same meaning (eos_token_id: added to the model's own)
    "stop_strings": "stop",
    "eos_token_id": "stop_token_ids",
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "include_stop_str_in_output": "no_stop_trim",
}
_DROPPED = {  # transformers generation options that mean nothing for an HTTP engine
    "pad_token_id": "SGLang pads nothing (it returns token ids per completion)",
    "bos_token_id": "prompts arrive as token ids",
    "use_cache": "SGLang always uses its KV cache",
    "cache_implementation": "SGLang manages its own KV cache",
    "output_scores": "SGLang returns the sampled tokens' logprobs",
    "output_logits": "SGLang returns the sampled tokens' logprobs",
    "return_dict_in_generate": "not a sampling option",
    "output_attentions": "not a sampling option",
    "output_hidden_states": "not a sampling option",
    "disable_compile": "not a sampling option",
    "compile_config": "not a sampling option",
    "renormalize_logits": "SGLang samples from normalized probabilities",
}
_SEEDS = ("seed", "sampling_seed")
"""Refused (:func:`translate_generation_kwargs` says why): vLLM's ``seed`` seeds a request whose n samples
still differ, but SGLang 0.5.23 reads ``sampling_seed`` only with ``--enable-deterministic-inference``, and
then draws each token from a hash of (seed, position, token id) alone
(``sglang/srt/layers/sampler.py`` ``multinomial_with_seed``): the n samples of a prompt are identical."""

_REFUSED = {  # name -> what to use instead
    "n": "num_generations (the trainer sets SGLang's n from it)",
    "num_return_sequences": "num_generations (the trainer sets SGLang's n from it)",
    "beam_width": "sampling (GRPO needs samples and their logprobs; SGLang's beam search returns no logprobs)",
    "length_penalty": "nothing: it only applies to beam search, which GRPO cannot use (SGLang has none with logprobs)",
    "early_stopping": "nothing: it only applies to beam search",
    "num_beam_groups": "nothing: it only applies to beam search",
    "diversity_penalty": "nothing: it only applies to beam search",
    "constraints": "regex / json_schema / ebnf (SGLang's constrained decoding)",
    "force_words_ids": "regex / ebnf (SGLang's constrained decoding)",
    "max_length": "max_completion_length (SGLang's max_new_tokens counts completion tokens only)",
    "min_length": "min_new_tokens",
    "no_repeat_ngram_size": "repetition_penalty / frequency_penalty / presence_penalty (SGLang has no n-gram ban)",
    "encoder_no_repeat_ngram_size": "repetition_penalty (SGLang has no n-gram ban)",
    "typical_p": "top_p / min_p (SGLang has no typical sampling)",
    "epsilon_cutoff": "min_p (SGLang has no epsilon sampling)",
    "eta_cutoff": "min_p (SGLang has no eta sampling)",
    "top_h": "top_p / min_p",
    "bad_words_ids": "logit_bias={token_id: -100.0, ...} or a regex",
    "bad_words": "logit_bias={token_id: -100.0, ...} or a regex",
    "suppress_tokens": "logit_bias={token_id: -100.0, ...}",
    "begin_suppress_tokens": "logit_bias or a regex",
    "sequence_bias": "logit_bias (per token)",
    "allowed_token_ids": "a regex or logit_bias",
    "forced_bos_token_id": "a regex, or put the token at the end of the prompt",
    "forced_eos_token_id": "stop_token_ids",
    "exponential_decay_length_penalty": "max_completion_length",
    "penalty_alpha": "sampling (SGLang has no contrastive search)",
    "guidance_scale": "nothing (SGLang has no classifier-free guidance)",
    "watermarking_config": "watermark (needs SGLang started with --enable-watermark)",
    "assistant_model": "SGLang's speculative decoding flags on the server",
    "prompt_lookup_num_tokens": "SGLang's speculative decoding flags on the server",
    "dola_layers": "nothing (SGLang has no DoLa decoding)",
    "token_healing": "nothing (SGLang has no token healing)",
    "logprobs": "nothing: the trainer asks for the sampled tokens' logprobs itself",
    "prompt_logprobs": "nothing: the trainer computes prompt logprobs itself",
    "guided_decoding": "SGLang's regex / json_schema / ebnf / structural_tag keys directly",
    "structured_outputs": "SGLang's regex / json_schema / ebnf / structural_tag keys directly",
}


def translate_generation_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """TRL's ``generation_kwargs`` as SGLang sampling parameters.

    SGLang names pass unchanged; transformers / vLLM names with an exact SGLang counterpart are
    renamed, options with no effect on an HTTP engine are dropped, and everything else raises a
    ValueError naming what to use instead (one log line per adaptation). TRL's own generation hands
    these to transformers' ``GenerationConfig``; sent to SGLang unchanged they would come back as
    HTTP 400 at the first generation step.
    """
    if isinstance(kwargs, str) and kwargs.strip().startswith("{"):  # from the command line (as TrainingArguments does)
        import json

        kwargs = json.loads(kwargs)
    if not kwargs:
        return kwargs
    if not isinstance(kwargs, dict):
        raise ValueError(f"generation_kwargs must be a dict of sampling parameters, got {type(kwargs).__name__}")
    out: dict[str, Any] = {}
    named: dict[str, str] = {}
    """SGLang name -> the name the user gave (a renamed key), for the value checks' messages."""
    no_sampling = False  # do_sample=False was given
    for key, value in kwargs.items():
        if key in _SEEDS:
            raise ValueError(
                f"generation_kwargs {key}={value!r}: SGLang 0.5.23 has no per-request seed that works like vLLM's "
                "(which seeds a request and still gives its n samples different tokens). SGLang reads sampling_seed "
                "only when the server runs with --enable-deterministic-inference, and then draws every token from a "
                "hash of (seed, position, token id) alone, so the num_generations completions of a prompt come out "
                "identical and every GRPO advantage is zero. Drop it from generation_kwargs (the config's seed "
                "still seeds the trainer; SGLang's rollouts are not reproducible per sample)"
            )
        if key == "top_k" and type(value) is int and value == 0:
            # 0 means "no limit" to transformers, vLLM and TRL's own top_k field; SGLang spells it -1.
            log.info("generation_kwargs: top_k=0 (no limit) sent as SGLang's top_k=-1")
            out[key] = -1
        elif key in SGLANG_SAMPLING_PARAMS:
            out[key] = value
        elif key == "do_sample":
            if value is False:
                no_sampling = True
            elif value is True:
                log.info("generation_kwargs: do_sample=True dropped (SGLang always samples)")
            else:
                raise ValueError(f"generation_kwargs do_sample must be true or false, got {value!r:.80}")
        elif key == "num_beams":
            if value in (None, 1):
                log.info("generation_kwargs: num_beams=1 dropped (SGLang samples without beams)")
            else:
                raise ValueError(
                    f"generation_kwargs num_beams={value!r}: beam search gives GRPO no samples to compare and SGLang "
                    "0.5.23's beam search returns no logprobs; drop num_beams and sample num_generations completions "
                    "(temperature / top_p / top_k / min_p)"
                )
        elif key in _RENAMED:
            new = _RENAMED[key]
            if new in kwargs or new in out:
                raise ValueError(f"generation_kwargs has both {key!r} and SGLang's {new!r}: keep only {new!r}")
            if new == "stop_token_ids":
                log.warning(
                    "generation_kwargs: eos_token_id=%r sent as SGLang's stop_token_ids: SGLang stops at these ids"
                    " and still at the model's and tokenizer's own end-of-sequence ids (they are added to, not"
                    " replaced). TRL counts a completion that ends on an id it does not know as its EOS as"
                    " truncated (mask_truncated_completions masks it), as with vLLM's stop_token_ids",
                    value,
                )
                value = list(value) if isinstance(value, (list, tuple, set)) else [value]  # one id or several
            else:
                log.warning("generation_kwargs: %s=%r renamed to SGLang's %s", key, value, new)
            out[new] = value
            named[new] = key
        elif key in _DROPPED:
            log.warning("generation_kwargs: %s dropped (%s)", key, _DROPPED[key])
        elif key in _REFUSED:
            raise ValueError(
                f"generation_kwargs {key}={value!r} has no SGLang counterpart in /generate; use {_REFUSED[key]}. "
                "generation_kwargs reach SGLang as sampling parameters by SGLang's names: "
                + ", ".join(sorted(SGLANG_SAMPLING_PARAMS))
            )
        else:
            raise ValueError(
                f"generation_kwargs {key}={value!r} is not an SGLang sampling parameter (SGLang would answer HTTP 400)"
                ". "
                "Use SGLang's names: " + ", ".join(sorted(SGLANG_SAMPLING_PARAMS))
            )
    if no_sampling:  # greedy wins, as in transformers (which ignores top_k when it does not sample)
        if out.get("top_k") not in (None, 1):
            log.warning(
                "generation_kwargs: do_sample=False overrides top_k=%r (greedy, as in transformers)", out["top_k"]
            )
        out["top_k"] = 1
        log.warning(
            "generation_kwargs: do_sample=False -> top_k=1 for SGLang (greedy; SGLang 0.5.23 returns greedy tokens' "
            "logprobs without temperature scaling, so with temperature != 1 TRL's importance-sampling correction "
            "is off for these rollouts)"
        )
    check_sampling_values(out, named)
    return out


TRL_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_completion_length",
}
"""SGLang sampling parameter -> the TRL config field (and ``VLLMGeneration`` argument) it comes from."""


def sglang_sampling_params(
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int | None = 0,
    min_p: float | None = 0.0,
    repetition_penalty: float = 1.0,
    max_completion_length: int | None = 16,
    generation_kwargs: dict[str, Any] | None = None,
    structured_outputs_regex: str | None = None,
) -> dict[str, Any]:
    """The SGLang sampling parameters of every rollout request (all but ``n``), built in this one
    place for the config's checks (:func:`adapt_trl_fields`) and for
    :class:`~trainer_hooks.sglang_generation.SGLangGeneration`.

    TRL's sampling fields by SGLang's names (``top_k`` 0 or None -> -1, ``min_p`` None -> 0,
    ``max_completion_length`` -> ``max_new_tokens``); then ``generation_kwargs`` (SGLang's names, as
    :func:`translate_generation_kwargs` leaves them), which override them as in TRL; then
    ``structured_outputs_regex`` (TRL's ``vllm_structured_outputs_regex``) as SGLang's ``regex``,
    which replaces a grammar in ``generation_kwargs``: TRL's ``VLLMGeneration`` gives it precedence
    over ``generation_kwargs["structured_outputs"]``, and SGLang takes one grammar per request.

    Raises ValueError naming the setting for a value SGLang would refuse with HTTP 400
    (:func:`~trainer_hooks.sampling_checks.check_sampling_values`) and for several grammars in
    ``generation_kwargs``.
    """
    params: dict[str, Any] = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": -1 if top_k is None or top_k == 0 else top_k,
        "min_p": 0.0 if min_p is None else min_p,
        "repetition_penalty": repetition_penalty,
        "max_new_tokens": max_completion_length,
    }
    extra = dict(generation_kwargs or {})
    grammars = [k for k in CONSTRAINT_PARAMS if extra.get(k) is not None]
    if len(grammars) > 1:
        raise ValueError(
            f"generation_kwargs sets several SGLang constraints {grammars}; SGLang accepts one per request"
        )
    params.update(extra)
    if structured_outputs_regex is not None:
        for key in CONSTRAINT_PARAMS:
            params.pop(key, None)
        params["regex"] = structured_outputs_regex
    check_sampling_values(params, fields={k: f for k, f in TRL_SAMPLING_FIELDS.items() if k not in extra})
    return params


def config_sampling_params(config: Any) -> dict[str, Any]:
    """:func:`sglang_sampling_params` of a TRL config's fields, as TRL hands them to its generation
    backend (``generation_kwargs`` already translated)."""
    return sglang_sampling_params(
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        min_p=config.min_p,
        repetition_penalty=config.repetition_penalty,
        max_completion_length=config.max_completion_length,
        generation_kwargs=config.generation_kwargs,
        structured_outputs_regex=getattr(config, "vllm_structured_outputs_regex", None),
    )


def _warn_about_sampling(config: Any, params: dict[str, Any]) -> None:
    """One warning per sampling setting that SGLang applies differently from TRL's own generation."""
    regex = getattr(config, "vllm_structured_outputs_regex", None)
    replaced = [k for k in CONSTRAINT_PARAMS if (config.generation_kwargs or {}).get(k) is not None]
    if regex is not None and replaced:
        log.warning(
            "vllm_structured_outputs_regex takes precedence over generation_kwargs %s (as in TRL's VLLMGeneration; "
            "SGLang takes one grammar per request): only the regex is sent. Drop one of the two",
            replaced[0],
        )
    sampled_at = (config.generation_kwargs or {}).get("temperature")
    if sampled_at is not None and sampled_at != config.temperature:
        instead = (
            f"Set temperature={sampled_at:g} instead and drop it from generation_kwargs"
            if sampled_at > 0
            else "(temperature 0: greedy rollouts; TRL cannot score at temperature 0, so keep temperature > 0)"
        )
        log.warning(
            "generation_kwargs temperature=%g overrides temperature=%g for SGLang's sampling, but TRL scores the"
            " completions (the loss and the importance-sampling correction) at temperature=%g: the two disagree"
            " (as with TRL's vLLM generation). %s",
            sampled_at,
            config.temperature,
            config.temperature,
            instead,
        )
    penalty = params.get("repetition_penalty")
    if penalty is not None and penalty != 1.0:
        log.warning(
            "repetition_penalty=%g is adapted: SGLang 0.5.23 penalises only the tokens generated so far in each "
            "completion, not the prompt's tokens as vLLM and transformers do (and TRL's docs describe), and has no "
            "setting that penalises the prompt's too.%s",
            penalty,
            " Completions are rescored for the importance-sampling correction" if engine_logprobs_used(config) else "",
        )


_IGNORED_VLLM_FIELDS = {  # field: (TRL default, what to use with SGLang)
    "vllm_server_base_url": (None, "sglang_urls"),
    "vllm_server_host": ("0.0.0.0", "sglang_urls"),
    "vllm_server_port": (8000, "sglang_urls"),
    "vllm_server_timeout": (240.0, "sync_timeout (how long the trainer waits for SGLang and its replicas)"),
    "vllm_group_port": (51216, "nothing (weights travel as checkpoints through checkpoint_path)"),
    "vllm_gpu_memory_utilization": (0.3, "SGLang's --mem-fraction-static on the rollout server"),
    "vllm_tensor_parallel_size": (1, "SGLang's --tp-size on the rollout server"),
    "vllm_max_model_length": (None, "SGLang's --context-length on the rollout server"),
    "vllm_model_impl": ("vllm", "SGLang's --model-impl on the rollout server"),
    "vllm_enable_sleep_mode": (False, "nothing (colocate mode only; SGLang runs outside the trainer)"),
    "cache_implementation": (None, "nothing (SGLang manages its own KV cache)"),
    "ds3_gather_for_generation": (True, "nothing (every sync gathers the full weights to publish them)"),
}

TORCH_DEFAULT_PG_TIMEOUT_S = 1800.0
"""torch.distributed's default process-group timeout (used when transformers passes none)."""
COLLECTIVE_MARGIN_S = 300.0
"""Room in the collective budget for gathering and copying the weights on the main process."""
MIN_FITTED_REQUEST_TIMEOUT_S = 60.0
"""The shortest ``sglang_request_timeout`` the config lowers it to (with ``use_cpu=True``)."""


def generation_budget_s(sync_timeout: float, request_timeout: float, rescoring: bool) -> float:
    """The longest one ``generate`` runs: a first round (each request up to ``sglang_request_timeout``,
    two in a row when completions are rescored), retries for ``sync_timeout`` after the first failure
    in it (:class:`~trainer_hooks.sglang_endpoints.RetryBudget`), and one round in flight when that
    runs out."""
    return sync_timeout + 2 * requests_per_round(rescoring) * request_timeout


def sync_budget_s(sync_timeout: float, background_syncs: bool, checkpoint_bytes: int = 0) -> float:
    """The longest one sync keeps the other processes waiting: its write, the replicas' wait and
    retention (:func:`~trainer_hooks.checkpoint_publisher.background_sync_bound_s`); with background
    syncs (``max_staleness > 0``), the wait for the previous sync before anything is taken in, which
    gives up ``sync_timeout`` past that bound when the write is stuck. ``checkpoint_bytes``: what a
    checkpoint writes (0 while the model is not known: the config is built before it)."""
    bound = background_sync_bound_s(sync_timeout, checkpoint_bytes)
    return bound + (sync_timeout if background_syncs else 0.0)


def collective_budget_s(
    sync_timeout: float,
    request_timeout: float,
    rescoring: bool,
    *,
    background_syncs: bool = False,
    checkpoint_bytes: int = 0,
) -> float:
    """The longest the main process can work alone (HTTP, replica waits, checkpoint writes) while the
    other processes wait in a collective for its result or error: the longer of one ``generate``
    (:func:`generation_budget_s`) and one sync (:func:`sync_budget_s`), plus
    :data:`COLLECTIVE_MARGIN_S` (docs/trl-conformance.md, "The collective budget")."""
    generation = generation_budget_s(sync_timeout, request_timeout, rescoring)
    sync = sync_budget_s(sync_timeout, background_syncs, checkpoint_bytes)
    return max(generation, sync) + COLLECTIVE_MARGIN_S


def syncs_in_background(config: Any) -> bool:
    """Whether ``config`` lets syncs run in the background (``max_staleness > 0``; an invalid value,
    refused later by the config's own checks, counts as no)."""
    value = getattr(config, "max_staleness", 0)
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def process_group_timeout_s(config: Any) -> float:
    """The collective watchdog's timeout: ``ddp_timeout``, or torch's default with ``use_cpu=True``
    (transformers then starts the process group without ``ddp_timeout``)."""
    return TORCH_DEFAULT_PG_TIMEOUT_S if getattr(config, "use_cpu", False) else float(config.ddp_timeout)


def distribution_changing_keys(params: dict[str, Any]) -> list[str]:
    """The SGLang sampling parameters in ``params`` whose processing (a grammar, logit_bias,
    penalties, min_new_tokens) is in SGLang's returned logprobs but not in the trainer's."""
    keys = [k for k in CONSTRAINT_PARAMS if params.get(k) is not None]
    keys += [k for k in ("logit_bias", "min_new_tokens", "frequency_penalty", "presence_penalty") if params.get(k)]
    if params.get("repetition_penalty") not in (None, 1.0):
        keys.append("repetition_penalty")
    return sorted(keys)


def rescoring_needed(params: dict[str, Any]) -> bool:
    """Whether SGLang's returned logprobs include processing the trainer does not apply
    (:func:`distribution_changing_keys`), so the completions are rescored for the IS correction."""
    return bool(distribution_changing_keys(params))


def engine_logprobs_used(config: Any) -> bool:
    """Whether TRL reads the logprobs the rollout engine returns: GRPO's importance-sampling
    correction (``vllm_importance_sampling_correction``) and its off-policy sequence mask
    (``off_policy_mask_threshold``) do; RLOO asks for none. TRL's GRPO asks for them in any case
    (``logprobs=0``) and drops them otherwise, so they are then SGLang's own, never rescored."""
    return bool(getattr(config, "vllm_importance_sampling_correction", False)) or (
        getattr(config, "off_policy_mask_threshold", None) is not None
    )


def completions_rescored(config: Any, params: dict[str, Any]) -> bool:
    """Whether each batch of completions is rescored (a second, prefill-only request): TRL reads
    the engine's logprobs (:func:`engine_logprobs_used`) and ``params`` change SGLang's
    distribution (:func:`rescoring_needed`)."""
    return rescoring_needed(params) and engine_logprobs_used(config)


def greedy(params: dict[str, Any]) -> bool:
    """Whether SGLang decodes ``params`` greedily: ``top_k=1``, or a temperature below SGLang's 1e-6
    (which it turns into ``top_k=1``). SGLang 0.5.23 then returns the *untempered* log-softmax as the
    logprobs of a batch that is all greedy (``Sampler.forward``), the tempered one otherwise."""
    temperature = params.get("temperature")
    return params.get("top_k") == 1 or (temperature is not None and 0 <= temperature < 1e-6)


def uncorrected_staleness(config: Any, params: dict[str, Any]) -> str | None:
    """Why nothing corrects rollouts from older weights (``max_staleness > 0``), or None when TRL's
    importance-sampling correction does: RLOO has none; GRPO's can be turned off; and with
    ``temperature != 1`` greedy or distribution-changing sampling hands TRL NaN logprobs
    (``SGLangGeneration.logprob_source`` "none": ratio 1)."""
    if not syncs_in_background(config):
        return None
    if not hasattr(config, "vllm_importance_sampling_correction"):
        return f"RLOO ({type(config).__name__}) has no importance-sampling correction"
    if not config.vllm_importance_sampling_correction:
        return "vllm_importance_sampling_correction=False"
    if float(config.temperature) != 1.0 and (greedy(params) or rescoring_needed(params)):
        return (
            f"with temperature={config.temperature:g} and greedy or distribution-changing sampling"
            f" ({', '.join(distribution_changing_keys(params)) or 'top_k=1'}) the logprobs handed to TRL are NaN,"
            " which turns its correction off (docs/trl-conformance.md)"
        )
    return None


def adapt_trl_fields(config: Any, *, world_size: int) -> None:
    """Refuse or adapt the TRL fields that do not work as in TRL's own generation (before TRL's
    ``__post_init__``, which starts the process group with ``ddp_timeout``)."""
    config.generation_kwargs = translate_generation_kwargs(config.generation_kwargs)
    temperature = getattr(config, "temperature", 1.0)
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and not temperature > 0:
        raise ValueError(
            f"temperature={temperature!r}: TRL divides the policy's logits by it to score the completions (a"
            " division by zero at the first loss); keep it > 0. For greedy rollouts pass generation_kwargs="
            '{"do_sample": False} (SGLang samples with top_k=1)'
        )
    params = config_sampling_params(config)  # every sampling value checked, as SGLang will get them
    _warn_about_sampling(config, params)
    why = uncorrected_staleness(config, params)
    if why is not None:
        log.warning(
            "max_staleness=%d lets rollouts come from weights up to %d versions older than the policy being "
            "trained, and nothing corrects for that here: %s. The loss then treats those samples as on-policy "
            "(a biased gradient, shown in no metric). Set max_staleness=0, or keep the correction on%s",
            config.max_staleness,
            config.max_staleness,
            why,
            "" if why.startswith("RLOO") else " (GRPO: vllm_importance_sampling_correction=True, temperature=1.0)",
        )
    for name in ("use_transformers_continuous_batching", "use_transformers_paged"):
        if getattr(config, name, False):
            raise ValueError(
                f"{name}=True asks TRL to generate in the trainer with transformers, but trainer_hooks generates with "
                f"SGLang: drop {name}, or use trl's own config for in-process generation"
            )
    for name, (default, instead) in _IGNORED_VLLM_FIELDS.items():
        value = getattr(config, name, default)
        if value != default:
            log.warning("%s=%r is not used with SGLang rollouts; use %s", name, value, instead)
    if (
        getattr(config, "loss_type", None) == "vespo"
        and getattr(config, "vllm_importance_sampling_correction", False)
        and config.vllm_importance_sampling_mode not in ("token_truncate", "token_mask")
    ):
        log.warning(
            "loss_type='vespo': vllm_importance_sampling_mode %r -> 'token_truncate' (TRL's VESPO needs a "
            "token-level mode once the external-engine IS correction is on; set "
            "vllm_importance_sampling_mode='token_mask' or vllm_importance_sampling_correction=False to choose "
            "otherwise)",
            config.vllm_importance_sampling_mode,
        )
        config.vllm_importance_sampling_mode = "token_truncate"
    if world_size > 1:
        _fit_collective_budget(config, world_size, completions_rescored(config, params))


def _fit_collective_budget(config: Any, world_size: int, rescoring: bool) -> None:
    """Make the process group's timeout cover :func:`collective_budget_s`: raise ``ddp_timeout``, or
    with ``use_cpu=True`` (torch's default timeout, which transformers does not let ``ddp_timeout``
    change) lower ``sglang_request_timeout``, refusing a ``sync_timeout`` that leaves no room."""
    background = syncs_in_background(config)
    budget = collective_budget_s(
        config.sync_timeout, config.sglang_request_timeout, rescoring, background_syncs=background
    )
    if getattr(config, "use_cpu", False):
        if budget > TORCH_DEFAULT_PG_TIMEOUT_S:
            _fit_request_timeout_under_torchs_default(config, world_size, rescoring, background)
        return
    if config.ddp_timeout < budget:
        new = int(math.ceil(budget))
        log.warning(
            "ddp_timeout=%s s -> %d s: with %d processes the others wait in a collective while the main process "
            "talks to SGLang (one generate: sync_timeout %g s + 2 rounds of sglang_request_timeout %g s%s) or "
            "publishes a checkpoint (%g s%s), + %g s, and a shorter ddp_timeout would end a stuck request in a "
            "collective abort (NCCL/gloo watchdog) instead of the trainer's own error. To keep a shorter "
            "ddp_timeout, lower sglang_request_timeout and sync_timeout",
            config.ddp_timeout,
            new,
            world_size,
            config.sync_timeout,
            config.sglang_request_timeout,
            " x2 (rescoring)" if rescoring else "",
            sync_budget_s(config.sync_timeout, background),
            " with the wait for the previous background sync" if background else "",
            COLLECTIVE_MARGIN_S,
        )
        config.ddp_timeout = new


def _fit_request_timeout_under_torchs_default(config: Any, world_size: int, rescoring: bool, background: bool) -> None:
    """With ``use_cpu=True``: lower ``sglang_request_timeout`` so that :func:`collective_budget_s`
    fits under torch's default process-group timeout, or refuse a ``sync_timeout`` too long for it."""
    room = TORCH_DEFAULT_PG_TIMEOUT_S - COLLECTIVE_MARGIN_S
    requests = 2 * requests_per_round(rescoring)
    limit = min(room - MIN_FITTED_REQUEST_TIMEOUT_S * requests, _longest_sync_timeout(room, background))
    if config.sync_timeout > limit:
        raise ValueError(
            f"with use_cpu=True and {world_size} processes the process group runs with torch's default timeout "
            f"({TORCH_DEFAULT_PG_TIMEOUT_S:g} s; transformers does not pass ddp_timeout then), which "
            f"sync_timeout={config.sync_timeout:g} s leaves no room under for SGLang requests and checkpoint syncs"
            + (" (with max_staleness > 0 a sync first waits for the previous one)" if background else "")
            + f": lower sync_timeout to at most {int(limit)} s"
            + (", or set max_staleness=0" if background else "")
        )
    fitted = float(int((room - config.sync_timeout) / requests))
    log.warning(
        "sglang_request_timeout=%g s -> %d s: with use_cpu=True transformers starts the %d-process group "
        "with torch's default timeout (%g s, ddp_timeout is not used), and the main process must report a "
        "stuck request before that watchdog aborts the other processes (sync_timeout %g s + %d requests + %g s)",
        config.sglang_request_timeout,
        int(fitted),
        world_size,
        TORCH_DEFAULT_PG_TIMEOUT_S,
        config.sync_timeout,
        requests,
        COLLECTIVE_MARGIN_S,
    )
    config.sglang_request_timeout = fitted


def _longest_sync_timeout(room: float, background: bool) -> float:
    """The longest ``sync_timeout`` whose :func:`sync_budget_s` fits in ``room`` seconds (it grows
    linearly with ``sync_timeout``)."""
    base = sync_budget_s(0.0, background)
    per_second = sync_budget_s(1.0, background) - base
    return (room - base) / per_second


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1
