"""Configuration of one sidecar (from CLI flags or ``ROLLOUT_*`` environment variables)."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint_paths import is_inside
from ..cli_env import setting

_REPLICA_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass
class SidecarSettings:
    """What a sidecar watches, whom it talks to, and how it serves its own API.

    Each field whose metadata is a ``setting`` is also a flag of ``rollout-service sidecar`` (and ``serve``)
    and a ``ROLLOUT_*`` variable, derived from this declaration (see ``rollout_service.cli_env``).
    The other fields are tuning knobs for tests and embedders, not on the command line.
    """

    checkpoint_path: Path = field(
        metadata=setting("--checkpoint-path", "checkpoint root the trainer publishes step-* directories into")
    )
    sglang_url: str = field(metadata=setting("--sglang-url", "SGLang server to load checkpoints into"))
    replica_id: str = field(
        default="",
        metadata=setting("--replica-id", "name of this replica in acks/<id>.json and /status (default: HOSTNAME-PORT)"),
    )
    poll_interval_s: float | None = field(
        default=None,
        metadata=setting("--poll", "poll the checkpoint root every N seconds instead of inotify (NFS, CephFS, Lustre)"),
    )
    """None: inotify; a number: the polling observer's period."""
    host: str = field(default="127.0.0.1", metadata=setting("--host", "address the sidecar binds to"))
    port: int = field(default=8100, metadata=setting("--port", "port of the sidecar's HTTP API"))
    token: str | None = field(
        default=None,
        metadata=setting("--token", "token required by POST endpoints ('Authorization: Bearer TOKEN')"),
    )
    sglang_api_key: str | None = field(
        default=None, metadata=setting("--sglang-api-key", "API key SGLang was started with, if any")
    )
    reference_dir: Path | None = field(
        default=None,
        metadata=setting(
            "--reference-dir",
            "model directory whose tensor names/shapes new checkpoints must match (default:"
            " the model SGLang serves, learnt from its model_path, or the reference the stage kept)",
        ),
    )
    check_digests: bool = field(
        default=False,
        metadata=setting(
            "--check-digests", "re-read every byte and check digests before loading (slower, catches bit rot)"
        ),
    )
    health_interval_s: float = field(
        default=2.0, metadata=setting("--health-interval", "seconds between SGLang health checks")
    )
    deep_health_interval_s: float = field(
        default=30.0,
        metadata=setting(
            "--deep-health-interval", "seconds between SGLang /health calls (each runs a one-token generation)"
        ),
    )
    rescan_interval_s: float = 30.0
    ack_interval_s: float = 5.0
    load_timeout_s: float = field(
        default=1800.0,
        metadata=setting("--load-timeout", "seconds to allow one /update_weights_from_disk call"),
    )
    request_timeout_s: float = 10.0
    stage: bool = field(
        default=True,
        metadata=setting(
            "--no-stage",
            "let SGLang read checkpoints straight from shared storage (no copy; a writer can"
            " then change files between validation and SGLang's read)",
        ),
    )
    """Copy and verify each checkpoint node-locally before SGLang reads it (closes the
    time-of-check/time-of-use window; see ``sidecar/staging.py``)."""
    stage_dir: Path | None = field(
        default=None,
        metadata=setting(
            "--stage-dir",
            "node-local folder (one per replica) where each checkpoint is copied and every"
            " byte verified before SGLang reads it (default: /dev/shm/rollout-stage-REPLICA when"
            " /dev/shm has 8 GiB free, else ~/.cache/rollout-service/stage/REPLICA)",
        ),
    )
    """None with stage=True: /dev/shm when it has room, else ~/.cache."""
    check_finite: bool = field(
        default=True,
        metadata=setting(
            "--no-check-finite",
            "do not refuse NaN/Inf weights (checked on bytes that staging or --check-digests reads anyway)",
        ),
    )
    """Refuse NaN/Inf weights (checked on the bytes the stage or digest mode reads anyway)."""
    validate_timeout_s: float = field(
        default=600.0,
        metadata=setting(
            "--validate-timeout",
            "seconds one checkpoint's validation (and staging copy) may take before the step is rejected",
        ),
    )
    lora_keep: int = field(
        default=3,
        metadata=setting(
            "--lora-keep",
            "LoRA adapter versions kept loaded in SGLang (adapter sync); older ones are unloaded"
            " once no request uses them. At least the trainer's max_staleness + 1",
        ),
    )

    def __post_init__(self) -> None:
        # Absolute from here on: paths built from the root are confined to it by resolve_inside,
        # which reads a relative path as relative to the root (a relative root would double).
        self.checkpoint_path = Path(self.checkpoint_path).expanduser().absolute()
        if not self.replica_id:
            self.replica_id = f"{socket.gethostname()}-{self.port}"
        if not _REPLICA_RE.match(self.replica_id):
            raise ValueError(
                f"replica id {self.replica_id!r} is not usable as a file name: use letters, digits,"
                " '.', '_' and '-' (at most 128 characters)"
            )
        self.sglang_url = self.sglang_url.rstrip("/")
        if not self.sglang_url.startswith(("http://", "https://")):
            raise ValueError(f"--sglang-url must start with http:// or https://, got {self.sglang_url!r}")
        if self.poll_interval_s is not None and self.poll_interval_s <= 0:
            raise ValueError(f"--poll must be a positive number of seconds, got {self.poll_interval_s}")
        if not self.checkpoint_path.is_dir():
            raise ValueError(
                f"checkpoint path {self.checkpoint_path} is not a directory; create it or mount"
                " the shared checkpoint volume there"
            )
        if self.reference_dir is not None:
            self.reference_dir = Path(self.reference_dir)
        if not self.stage:
            self.stage_dir = None
        elif self.stage_dir is None:
            from .staging import default_stage_dir

            self.stage_dir = default_stage_dir(self.replica_id)
        else:
            self.stage_dir = Path(self.stage_dir).expanduser().absolute()
        if self.stage_dir is not None and is_inside(self.stage_dir, self.checkpoint_path):
            raise ValueError(
                f"--stage-dir {self.stage_dir} is inside the checkpoint root; it must be"
                " node-local and private to this sidecar"
            )
        if self.lora_keep < 1:
            raise ValueError(f"--lora-keep must be at least 1, got {self.lora_keep}")
        if not self.validate_timeout_s > 0:
            raise ValueError(f"--validate-timeout must be positive, got {self.validate_timeout_s}")
