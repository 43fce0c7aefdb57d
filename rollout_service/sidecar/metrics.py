"""Prometheus metrics of one sidecar (own registry, so several sidecars can share a process)."""

from __future__ import annotations

import contextlib
import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .sync_record import SyncRecord

NAMESPACE = "rollout_sidecar"
SYNC_PHASES = ("detect", "validate", "apply", "load", "total")
"""The phases of :class:`SyncRecord` (its ``<phase>_s`` fields) ``last_sync_seconds`` shows."""


class SidecarMetrics:
    """Every sync outcome, phase time, and server event, as named series."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.syncs = Counter(
            "syncs",
            "Checkpoint syncs by outcome (loaded, rejected, failed) and reason",
            ["outcome", "reason"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.last_sync_seconds = Gauge(
            "last_sync_seconds",
            "Seconds spent in each phase of the last"
            " successful sync (detect, validate, apply, load, total; apply: copying or"
            " rebuilding in the stage, part of validate)",
            ["phase"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.loaded_version = Gauge(
            "loaded_version", "Checkpoint step SGLang is serving (-1: base weights)", namespace=NAMESPACE, registry=r
        )
        self.detection_latency = Histogram(
            "detection_latency_seconds",
            "Publish finished (step directory renamed into place) -> seen by the sidecar, for steps that loaded",
            namespace=NAMESPACE,
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
        )
        self.sglang_restarts = Counter(
            "sglang_restarts",
            "Times SGLang was seen to come back with lost weights (a restart)",
            namespace=NAMESPACE,
            registry=r,
        )
        self.sglang_up = Gauge("sglang_up", "1 when SGLang answers /health", namespace=NAMESPACE, registry=r)
        self.ready = Gauge("ready", "1 when serving the newest valid checkpoint", namespace=NAMESPACE, registry=r)
        self.synced_bytes = Counter(
            "synced_bytes",
            "Bytes read from shared storage by syncs, by the published step's kind (full, delta, adapter)",
            ["kind"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.last_sync_kind = Gauge(
            "last_sync_kind",
            "1 for the kind of the last successful sync (full, delta, adapter)",
            ["kind"],
            namespace=NAMESPACE,
            registry=r,
        )
        self.last_sync_bytes_read = Gauge(
            "last_sync_bytes_read",
            "Bytes the last successful sync read from shared storage (NaN: not counted, SGLang read them)",
            namespace=NAMESPACE,
            registry=r,
        )
        self.chain_length = Gauge(
            "last_sync_chain_length",
            "Deltas the last successful sync applied (0: a full step)",
            namespace=NAMESPACE,
            registry=r,
        )
        self.stage_bytes = Gauge(
            "stage_bytes", "Bytes held in the node-local stage directory", namespace=NAMESPACE, registry=r
        )
        self.root_responsive = Gauge(
            "root_responsive",
            "0 while the checkpoint root does not answer within --root-timeout (a hung network file system)",
            namespace=NAMESPACE,
            registry=r,
        )
        self.loaded_version.set(-1)
        self.root_responsive.set(1)

    def record_sync(self, record: SyncRecord) -> None:
        """A sync that loaded: every ``last_sync`` series describes it alone, as ``/status``
        does (a phase it has no time for, or bytes it did not count, is dropped or NaN, never
        left from an earlier sync)."""
        for phase in SYNC_PHASES:
            value = getattr(record, f"{phase}_s")
            if value is None:
                with contextlib.suppress(KeyError):
                    self.last_sync_seconds.remove(phase)
            else:
                self.last_sync_seconds.labels(phase).set(value)
        if record.detect_s is not None:
            self.detection_latency.observe(record.detect_s)
        for k in ("full", "delta", "adapter"):
            self.last_sync_kind.labels(k).set(1 if k == record.kind else 0)
        if record.bytes_read is not None:
            self.synced_bytes.labels(record.kind).inc(record.bytes_read)
        self.last_sync_bytes_read.set(math.nan if record.bytes_read is None else record.bytes_read)
        self.chain_length.set(record.chain_length)
