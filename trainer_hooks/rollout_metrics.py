"""The ``sglang/*`` metrics the trainer logs beside TRL's own.

:class:`RolloutMetrics` collects them on the main process from the records the backend already
keeps, and hands them over once per log call (the trainer's ``log`` extends its metric lists
with :meth:`~RolloutMetrics.drain`):

- per sync (:class:`~trainer_hooks.checkpoint_publisher.SyncRecord`): ``sglang/sync_version``,
  ``sync_gather_s``, ``sync_write_s``, ``sync_wait_s``, ``sync_total_s``, ``sync_mb`` (what was
  written), ``sync_full_mb`` (what a full checkpoint is) and ``sync_delta`` (1 for a delta);
- per ``generate`` call (:class:`~trainer_hooks.stale_retry.GenerationRecord`):
  ``sglang/version_lag`` (newest published version minus the oldest that answered),
  ``stale_retries`` and ``generate_s``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .checkpoint_publisher import SyncRecord

if TYPE_CHECKING:
    from .stale_retry import GenerationRecord


class RolloutMetrics:
    """Metric values recorded since the last :meth:`drain`, by name."""

    def __init__(self) -> None:
        self._values: defaultdict[str, list[float]] = defaultdict(list)

    def add(self, key: str, value: float | None) -> None:
        """Record one value (None: nothing to record)."""
        if value is not None:
            self._values[key].append(float(value))

    def add_syncs(self, records: Iterable[SyncRecord]) -> None:
        """Record finished syncs."""
        for record in records:
            self.add("sglang/sync_version", record.version)
            self.add("sglang/sync_gather_s", record.gather_s)
            self.add("sglang/sync_write_s", record.write_s)
            self.add("sglang/sync_wait_s", record.wait_s)
            self.add("sglang/sync_total_s", record.total_s)
            self.add("sglang/sync_mb", record.bytes / 1e6)
            self.add("sglang/sync_full_mb", record.full_bytes / 1e6)
            self.add("sglang/sync_delta", 1.0 if record.kind == "delta" else 0.0)

    def add_generation(self, record: GenerationRecord) -> None:
        """Record one ``generate`` call."""
        known = [v for v in record.versions if v is not None]
        if record.published_version is not None and known:
            self.add("sglang/version_lag", record.published_version - min(known))
        self.add("sglang/stale_retries", record.stale_retries)
        self.add("sglang/generate_s", record.seconds)

    def drain(self) -> dict[str, list[float]]:
        """Everything recorded since the last call, which starts a new collection."""
        values, self._values = self._values, defaultdict(list)
        return dict(values)
