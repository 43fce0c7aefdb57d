"""Configuration of one sidecar (from CLI flags or ``ROLLOUT_*`` environment variables)."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint_paths import is_inside

_REPLICA_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass
class SidecarSettings:
    """What a sidecar watches, whom it talks to, and how it serves its own API."""

    checkpoint_path: Path
    sglang_url: str
    replica_id: str = ""
    poll_interval_s: float | None = None  # None: inotify; a number: polling observer period
    host: str = "127.0.0.1"
    port: int = 8100
    token: str | None = None
    sglang_api_key: str | None = None
    reference_dir: Path | None = None
    check_digests: bool = False
    health_interval_s: float = 2.0
    deep_health_interval_s: float = 30.0
    rescan_interval_s: float = 30.0
    ack_interval_s: float = 5.0
    load_timeout_s: float = 1800.0
    request_timeout_s: float = 10.0
    stage: bool = True
    """Copy and verify each checkpoint node-locally before SGLang reads it (closes the
    time-of-check/time-of-use window; see ``sidecar/staging.py``)."""
    stage_dir: Path | None = None  # None with stage=True: /dev/shm when it has room, else ~/.cache
    check_finite: bool = True
    """Refuse NaN/Inf weights (checked on the bytes the stage or digest mode reads anyway)."""
    validate_timeout_s: float = 600.0
    lora_keep: int = 3
    """LoRA adapter versions kept loaded in SGLang (older ones are unloaded once unused); at
    least the trainer's ``max_staleness + 1``."""

    def __post_init__(self) -> None:
        self.checkpoint_path = Path(self.checkpoint_path)
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
            self.stage_dir = Path(self.stage_dir)
        if self.stage_dir is not None and is_inside(self.stage_dir, self.checkpoint_path):
            raise ValueError(
                f"--stage-dir {self.stage_dir} is inside the checkpoint root; it must be"
                " node-local and private to this sidecar"
            )
        if self.lora_keep < 1:
            raise ValueError(f"--lora-keep must be at least 1, got {self.lora_keep}")
        if not self.validate_timeout_s > 0:
            raise ValueError(f"--validate-timeout must be positive, got {self.validate_timeout_s}")
