"""Training arguments for GRPO with SGLang rollout servers synced through a checkpoint root.

:class:`GRPOConfig` is TRL's ``GRPOConfig`` plus the fields that say where checkpoints go
(``checkpoint_path``), which SGLang servers generate (``sglang_urls``) and how the trainer
learns that every replica loaded a checkpoint (``sidecar_urls`` or ``expected_replicas``).
Everything is checked in ``__post_init__``, so a wrong path or a missing endpoint fails when
the arguments are built, not after the first training step.

TRL's own fields keep their meaning. ``use_vllm`` is TRL's switch for "generate with an external
engine" and gates its importance-sampling correction (``vllm_importance_sampling_*``), so it is
True here and must stay True; ``vllm_mode`` must stay ``"server"`` (the engine runs outside the
trainer). The other ``vllm_*`` settings (server host/port, colocate memory) are not used.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import trl

from rollout_service.checkpoint_format import normalize_dtype

DEFAULT_SYNC_TIMEOUT_S = 600.0
DEFAULT_REQUEST_TIMEOUT_S = 1800.0


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
            while rollouts continue on weights at most k versions old.
        checkpoint_dtype: floating dtype of published checkpoints ("bfloat16", "float16",
            "float32"); default: the model's configured dtype (what SGLang serves).
        checkpoint_max_shard_mb: largest safetensors shard written, in MB.
        keep_checkpoints: how many newest checkpoints to keep; older ones are deleted unless a
            live replica still serves or loads them. None keeps everything.
        sidecar_token: bearer token of the sidecars' ``POST /sync`` (when they were given one).
        sglang_request_timeout: seconds one ``POST /generate`` may take before its endpoint
            counts as failed.
        replica_heartbeat_max_age: seconds after which an ack file's heartbeat counts as dead
            (sidecars refresh it every few seconds).
    """

    checkpoint_path: str | None = field(
        default=None,
        metadata={"help": "Shared directory the trainer publishes step-XXXXXXXX checkpoints into "
                  "(the directory the SGLang sidecars watch)."},
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
        metadata={"help": "Versions a rollout's weights may lag the newest checkpoint (0: none; "
                  ">0: publish in the background)."},
    )
    checkpoint_dtype: str | None = field(
        default=None,
        metadata={"help": "dtype of published checkpoints (default: the model's configured dtype)."},
    )
    checkpoint_max_shard_mb: float = field(
        default=2048.0, metadata={"help": "Largest safetensors shard written, in MB."},
    )
    keep_checkpoints: int | None = field(
        default=3,
        metadata={"help": "Newest checkpoints to keep (None: keep all); a version a live replica "
                  "serves or loads is never deleted."},
    )
    sidecar_token: str | None = field(
        default=None, metadata={"help": "Bearer token of the sidecars' POST /sync."},
    )
    sglang_api_token: str | None = field(
        default=None,
        metadata={"help": "The --api-key SGLang was started with, sent as a Bearer token with every request "
                  "(named *_token so that TrainingArguments redacts it in logs)."},
    )
    sglang_request_timeout: float = field(
        default=DEFAULT_REQUEST_TIMEOUT_S,
        metadata={"help": "Seconds one POST /generate may take before its endpoint counts as failed."},
    )
    replica_heartbeat_max_age: float = field(
        default=60.0,
        metadata={"help": "Seconds after which an ack file's heartbeat counts as dead."},
    )

    def _validate_rollout_arguments(self, *, is_main_process: bool) -> None:
        """Check and normalize the SGLang fields; raise ValueError saying what to change."""
        if not self.use_vllm:  # type: ignore[attr-defined]
            raise ValueError(
                "use_vllm=False was passed to trainer_hooks' config, which generates with SGLang: TRL's "
                "use_vllm switch means 'generate with an external engine' here and gates the importance-"
                "sampling correction, so it must stay True. For in-process generation use trl's own config."
            )
        if self.vllm_mode != "server":  # type: ignore[attr-defined]
            raise ValueError(
                f"vllm_mode={self.vllm_mode!r} was passed, but SGLang runs outside the trainer: "  # type: ignore[attr-defined]
                "use vllm_mode='server' (the default of trainer_hooks' config)."
            )
        self.sglang_urls = _normalize_urls(self.sglang_urls, "sglang_urls")
        self.sidecar_urls = _normalize_urls(self.sidecar_urls, "sidecar_urls")
        if not self.sglang_urls:
            raise ValueError(
                "no SGLang endpoint: set sglang_urls to one server, several servers or a router URL, "
                "e.g. sglang_urls=['http://127.0.0.1:30000']"
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
        if self.expected_replicas is not None and self.expected_replicas < 1:
            raise ValueError(f"expected_replicas must be at least 1, got {self.expected_replicas}")
        _require_positive(self.sync_timeout, "sync_timeout")
        _require_positive(self.sglang_request_timeout, "sglang_request_timeout")
        _require_positive(self.checkpoint_max_shard_mb, "checkpoint_max_shard_mb")
        _require_positive(self.replica_heartbeat_max_age, "replica_heartbeat_max_age")
        if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0, got {self.max_staleness!r}")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ValueError(
                f"keep_checkpoints must be at least 1 (the newest checkpoint is what replicas load) or None "
                f"to keep everything, got {self.keep_checkpoints}"
            )
        if self.checkpoint_dtype is not None:
            normalize_dtype(self.checkpoint_dtype)
        if self.checkpoint_path is None or str(self.checkpoint_path).strip() == "":
            raise ValueError(
                "checkpoint_path is required: the shared directory the trainer publishes checkpoints into "
                "and the SGLang sidecars watch (the --checkpoint-path of `rollout-service serve`)"
            )
        self.checkpoint_path = os.fspath(Path(self.checkpoint_path).expanduser().absolute())
        if is_main_process:
            check_checkpoint_dir(Path(self.checkpoint_path))


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
        url = str(url).strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{name} entries must start with http:// or https://, got {url!r}")
        if url not in out:
            out.append(url)
    return out


def _require_positive(value: float, name: str) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds or MB, got {value!r}")


@dataclass
class GRPOConfig(SGLangRolloutArguments, trl.GRPOConfig):
    """TRL's GRPOConfig for training with SGLang rollout servers (see :class:`SGLangRolloutArguments`)."""

    use_vllm: bool = field(
        default=True,
        metadata={"help": "Generate with the external engine (SGLang here); must stay True."},
    )
    vllm_mode: str = field(
        default="server",
        metadata={"help": "Must stay 'server': SGLang runs outside the trainer."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self._validate_rollout_arguments(is_main_process=self.process_index == 0)


@dataclass
class RLOOConfig(SGLangRolloutArguments, trl.RLOOConfig):
    """TRL's RLOOConfig for training with SGLang rollout servers (see :class:`SGLangRolloutArguments`)."""

    use_vllm: bool = field(
        default=True,
        metadata={"help": "Generate with the external engine (SGLang here); must stay True."},
    )
    vllm_mode: str = field(
        default="server",
        metadata={"help": "Must stay 'server': SGLang runs outside the trainer."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self._validate_rollout_arguments(is_main_process=self.process_index == 0)
