"""What a sidecar knows about its replica: the one record ``/status`` and the replica acks report.

Only the sync loop (``controller.py``) changes it; the HTTP API and the ack writer read it.
"""

from __future__ import annotations

import copy
import heapq
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..protocol import ReplicaReport, version_for_step
from .sync_record import SyncRecord

MAX_REPORTED_REJECTIONS = 64
"""Rejections a report names (the newest steps): junk dropped under the root by the thousand
must not grow the ack file past what the trainer reads (``protocol.MAX_ACK_BYTES``)."""


@dataclass
class SidecarState:
    """Everything ``/status`` reports."""

    replica_id: str
    checkpoint_path: str
    sglang_url: str
    watch_mode: str = "inotify"
    loaded_step: int | None = None
    loaded_run_id: str | None = None
    loaded_fingerprint: str | None = None
    loaded_current: bool = True
    """False once the served checkpoint's directory is gone or was republished."""
    loading_step: int | None = None
    sglang_loading_step: int | None = None
    """The step whose load SGLang runs now (its weight or adapter load call is in flight; not
    while the step is validated or staged): SGLang's ``/health`` waits on it, and
    ``rollout-service liveness`` counts SGLang alive meanwhile."""
    newest_known_step: int | None = None
    sglang_healthy: bool = False
    sglang_weight_version: str | None = None
    sglang_seen_at: float | None = None
    sglang_seen_mono: float | None = None
    """``time.monotonic()`` of ``sglang_seen_at``: what silence is measured with (a step of the wall
    clock, a resumed VM, must not make a live SGLang look hung). Not in ``/status``."""
    ready: bool = False
    last_sync: SyncRecord | None = None
    last_error: dict[str, Any] | None = None
    rejected: dict[int, str] = field(default_factory=dict)
    ack_error: str | None = None
    root_problem: str | None = None
    """Why the checkpoint root counts as not answering (None: it answered at the last pass)."""
    reference: str | None = None
    """Where the served model's tensor reference came from."""
    stage_dir: str | None = None
    stage_bytes: int | None = None
    """Bytes held in the stage directory after the last sync."""
    loop_heartbeat: float | None = None
    loop_errors: int = 0
    fatal: dict[str, Any] | None = None
    """Set when the replica cannot recover by itself (e.g. its restart budget is spent)."""
    started_at: float = field(default_factory=time.time)

    def saw_sglang(self) -> None:
        """SGLang answered now."""
        self.sglang_seen_at, self.sglang_seen_mono = time.time(), time.monotonic()

    def report(self) -> ReplicaReport:
        """The part of the state the trainer reads (the replica protocol)."""
        return ReplicaReport(
            replica_id=self.replica_id,
            loaded_step=self.loaded_step,
            weight_version=None if self.loaded_step is None else version_for_step(self.loaded_step),
            run_id=self.loaded_run_id,
            fingerprint=self.loaded_fingerprint,
            loaded_current=self.loaded_current,
            loading_step=self.loading_step,
            ready=self.ready,
            sglang_healthy=self.sglang_healthy,
            sglang_url=self.sglang_url,
            last_error=self.last_error,
            rejected={str(k): self.rejected[k] for k in sorted(heapq.nlargest(MAX_REPORTED_REJECTIONS, self.rejected))},
            fatal=self.fatal,
        )

    def to_dict(self) -> dict[str, Any]:
        """``/status``: the replica report and everything else the sidecar knows."""
        # Field by field, without the rejections (junk by the million costs a copy per /status and
        # per /wait answer otherwise): the report below names the newest ones.
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("rejected", "sglang_seen_mono")}
        data["last_sync"] = None if self.last_sync is None else asdict(self.last_sync)
        data = copy.deepcopy(data)
        data["loaded_version"] = None if self.loaded_step is None else version_for_step(self.loaded_step)
        data["pending_step"] = (
            self.newest_known_step
            if self.newest_known_step is not None and self.newest_known_step != self.loaded_step
            else None
        )
        data.update(self.report().to_dict())
        data["rejected_count"] = len(self.rejected)
        return data
