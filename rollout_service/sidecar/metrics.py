"""Prometheus metrics of one sidecar (own registry, so several sidecars can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

NAMESPACE = "rollout_sidecar"


class SidecarMetrics:
    """Every sync outcome, phase time, and server event, as named series."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.syncs = Counter("syncs", "Checkpoint syncs by outcome (loaded, rejected, failed) and reason",
                             ["outcome", "reason"], namespace=NAMESPACE, registry=r)
        self.last_sync_seconds = Gauge("last_sync_seconds", "Seconds spent in each phase of the last"
                                       " successful sync (detect, validate, load, total)", ["phase"],
                                       namespace=NAMESPACE, registry=r)
        self.loaded_version = Gauge("loaded_version", "Checkpoint step SGLang is serving (-1: base"
                                    " weights)", namespace=NAMESPACE, registry=r)
        self.detection_latency = Histogram(
            "detection_latency_seconds", "Publish finished (step directory renamed into place) ->"
            " load started", namespace=NAMESPACE, registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))
        self.sglang_restarts = Counter("sglang_restarts", "Times SGLang was seen to come back with"
                                       " lost weights or after being down", namespace=NAMESPACE,
                                       registry=r)
        self.sglang_up = Gauge("sglang_up", "1 when SGLang answers /health", namespace=NAMESPACE,
                               registry=r)
        self.ready = Gauge("ready", "1 when serving the newest valid checkpoint", namespace=NAMESPACE,
                           registry=r)
        self.loaded_version.set(-1)
