"""The staleness bound and the retries it takes: what the trainer accepts from SGLang, and how long it tries.

Rollouts may come from weights at most ``max_staleness`` versions older than the newest version
the trainer published (never older than its first one, and never newer than the newest: such a
version is another run's checkpoint; before the first sync anything goes). An answer without a
version (SGLang's start-up ``"default"``, or a ``weight_version`` that is missing or not a version
string) is not within the bound either.
:class:`StaleRetryPolicy` holds that rule on the main process:

- :meth:`~StaleRetryPolicy.generate` sends the unique prompt groups to SGLang and generates again
  every group that came back aborted (a restart or a weight update cut it off) or from weights
  outside the bound, after waiting for the replicas to catch up, until ``sync_timeout`` runs
  out, counted from the first failure (an abort, an answer outside the bound, or an endpoint's
  failure: :class:`~trainer_hooks.sglang_endpoints.RetryBudget`), so a round of generation longer
  than ``sync_timeout`` still gets its retries; then it raises :class:`StaleWeightsError` (answers
  outside the bound, saying which kind) or ``RuntimeError`` (aborts).
- :meth:`~StaleRetryPolicy.publishes_in_background` says whether a sync may publish without
  waiting for the replicas (``max_staleness > 0``, after the first version).

Each call returns a :class:`GenerationRecord` of what it required and what answered.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from .adapter_publish import BASE_REPLACED, AdapterPublisher, label_with_adapter
from .checkpoint_publisher import CheckpointPublisher
from .replica_wait import ReplicaFailed, ReplicaSyncTimeout, ReplicaWaiter
from .sglang_endpoints import RetryBudget, SGLangEndpoints
from .sglang_responses import Completion

log = logging.getLogger(__name__)

STALE_RETRY_PAUSE_S = 1.0
"""Pause before the n-th retry: n times this, at most 5 s."""
STALE_WAIT_SLICE_S = 10.0
"""Longest wait for the replicas to serve the required version before one retry."""
SGLANG_START_VERSION = "default"
"""SGLang's ``weight_version`` before any checkpoint was loaded into it."""


class StaleWeightsError(RuntimeError):
    """SGLang kept answering with weights outside the staleness bound: older than it allows, newer
    than this run published (another run's), or without a weight version."""


@dataclass
class GenerationRecord:
    """What one ``generate`` call saw: the version it required and the versions that answered."""

    published_version: int | None
    required_version: int | None
    versions: list[int | None]
    stale_retries: int
    seconds: float


class StaleRetryPolicy:
    """Generates prompt groups until every answer is complete and within the staleness bound.

    Arguments:
        endpoints: the SGLang servers to ask.
        publisher: the trainer's checkpoint publisher (which versions were published).
        waiter: how to wait for the replicas to serve a version.
        max_staleness: how many versions older than the newest published one a rollout may be.
        sync_timeout_s: how long one ``generate`` call may retry, from its first failure (or its
            start, when that is later).
        adapters: with LoRA adapter sync, the adapter publisher whose newest served adapter the
            requests name (its version labels the completions).
    """

    def __init__(
        self,
        endpoints: SGLangEndpoints,
        publisher: CheckpointPublisher,
        waiter: ReplicaWaiter,
        *,
        max_staleness: int,
        sync_timeout_s: float,
        adapters: AdapterPublisher | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.publisher = publisher
        self.waiter = waiter
        self.max_staleness = int(max_staleness)
        self.sync_timeout_s = float(sync_timeout_s)
        self.adapters = adapters
        self.newest_only = False
        """Within evaluation (``SGLangGeneration.syncing_in_foreground``): completions must come
        from the newest version, whatever ``max_staleness`` allows in training (a replica not
        waited for, or behind a router, may still serve an older one)."""

    def publishes_in_background(self) -> bool:
        """Whether the next sync may publish without waiting for the replicas: rollouts may lag
        (``max_staleness > 0``), and the first version was waited for."""
        return self.max_staleness > 0 and self.publisher.first_version is not None

    def required_version(self) -> int | None:
        """The oldest checkpoint version a completion may come from (None before the first sync):
        the one published ``max_staleness`` publishes before the newest (counted in publishes, not
        in version numbers, which can skip), never one before this run's first."""
        return self.publisher.version_back(0 if self.newest_only else self.max_staleness)

    def generate(
        self, unique: list[list[int]], params: dict[str, Any], *, want_logprobs: bool, rescore: bool
    ) -> tuple[list[list[Completion]], GenerationRecord]:
        """One group of ``params["n"]`` completions per prompt of ``unique``, each complete and
        within the staleness bound; raises when ``sync_timeout_s`` ran out first, counted from the
        first failure (see the module docstring). ``want_logprobs`` and ``rescore`` are passed to the
        endpoints."""
        self.publisher.raise_if_failed()
        started = time.monotonic()
        budget = RetryBudget(started + self.sync_timeout_s, self.sync_timeout_s)
        self.endpoints.forget_crashes()
        groups: list[list[Completion] | None] = [None] * len(unique)
        todo = list(range(len(unique)))
        retries = 0
        while True:
            adapter = self.adapters.current() if self.adapters is not None else None
            answers = self.endpoints.generate(
                [unique[i] for i in todo],
                params,
                want_logprobs=want_logprobs,
                deadline=budget,
                rescore=rescore,
                lora_path=None if adapter is None else adapter[1],
            )
            if adapter is not None:
                label_with_adapter(answers, *adapter)
            required = self.required_version()
            retry: list[int] = []
            outside = _Outside()
            aborted = 0
            for i, group in zip(todo, answers):
                groups[i] = group
                if any(c.finish_reason == "abort" for c in group):
                    aborted += 1
                    retry.append(i)
                elif required is not None and outside.add(group, required, self.publisher.latest_version):
                    retry.append(i)
            stale_versions = outside.labels()
            if not retry:
                break
            budget.note_failure()
            if budget.ran_out():
                if stale_versions:
                    raise StaleWeightsError(self._outside_message(len(retry) - aborted, outside, required))
                raise RuntimeError(
                    f"SGLang kept aborting {aborted} prompt group(s) for sync_timeout={self.sync_timeout_s:g} s after"
                    f" the first failure ({retries + 1} attempt(s)); check the SGLang server logs behind"
                    f" {self.endpoints.urls}"
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
                    "%d prompt(s) answered with weights outside the staleness bound (versions %s, need %s .. %s); "
                    "waiting for the replicas and retrying (attempt %d)",
                    len(retry) - aborted,
                    _some(set(stale_versions)),
                    required,
                    self.publisher.latest_version,
                    retries,
                )
            self._wait_for_replicas(
                required if stale_versions else None, budget.deadline, pause=min(STALE_RETRY_PAUSE_S * retries, 5.0)
            )
            todo = retry
        done = [g for g in groups if g is not None]
        record = GenerationRecord(
            published_version=self.publisher.latest_version,
            required_version=self.required_version(),
            versions=[c.weight_version for g in done for c in g],
            stale_retries=retries,
            seconds=time.monotonic() - started,
        )
        return done, record

    def _outside_message(self, prompts: int, outside: _Outside, required: int | None) -> str:
        """Why the answers of ``prompts`` prompt(s) were still refused when ``sync_timeout`` ran out."""
        urls = self.endpoints.urls
        latest = self.publisher.latest_version
        parts = []
        if outside.older:
            parts.append(
                f"weights of version(s) {sorted(outside.older)}, but the trainer published version {latest} and "
                f"max_staleness={self.max_staleness} requires version >= {required}; the replicas did not catch up. "
                f"A replica behind the endpoints {urls} is not loading checkpoints: check its sidecar (GET /status) "
                "and its --checkpoint-path"
            )
        if outside.newer:
            parts.append(
                f"weights of version(s) {sorted(outside.newer, key=int)}, newer than any version this run published "
                f"(the newest is {latest}): another run's checkpoint, not this run's weights. A replica behind the "
                f"endpoints {urls} loads another run's checkpoints (another trainer publishes under its "
                "--checkpoint-path, or it watches another folder): point it at this run's checkpoint_path"
            )
        if outside.base_replaced:
            parts.append(
                f"this run's LoRA adapter run on full checkpoint version(s) {_some(outside.base_replaced)} instead of"
                " SGLang's base model: a full checkpoint was loaded into a replica behind the endpoints"
                f" {urls} (another run's, or one published under this checkpoint_path without adapter sync), and"
                " SGLang keeps adapters loaded over it. Restart that SGLang on its base model (adapters need it;"
                " its sidecar's /status says adapter_base_replaced), and give each run a checkpoint_path of its own"
            )
        if outside.missing:
            parts.append(
                "no meta_info.weight_version at all: SGLang too old to report it (use the SGLang version "
                f"rollout-service pins), or a server behind {urls} not started by `rollout-service serve`"
            )
        if outside.malformed:
            parts.append(
                "a meta_info.weight_version that is not a version string (up to 8 decimal digits): "
                f"{_some(outside.malformed)}; a server behind {urls} not started by `rollout-service serve` "
                "(whose sidecar labels each checkpoint it loads with its version)"
            )
        return (
            f"SGLang kept answering {prompts} prompt(s) with "
            + "; and with ".join(parts)
            + f" (retried for sync_timeout={self.sync_timeout_s:g} s after the first failure)"
        )

    def _wait_for_replicas(self, version: int | None, deadline: float, pause: float) -> None:
        remaining = deadline - time.monotonic()
        if version is not None and remaining > 0:
            try:
                self.waiter.wait(version, min(STALE_WAIT_SLICE_S, remaining))
            except ReplicaFailed:
                raise  # it will never catch up: retrying until sync_timeout would only hide why
            except ReplicaSyncTimeout:
                pass
        time.sleep(max(0.0, min(pause, deadline - time.monotonic())))


class _Outside:
    """The weight versions of one round's answers that the staleness bound refuses, by kind."""

    def __init__(self) -> None:
        self.older: set[str] = set()
        """Versions older than required, and SGLang's start-up ``"default"`` (no checkpoint loaded)."""
        self.newer: set[str] = set()
        """Versions newer than this run published: another run's checkpoints."""
        self.missing = False
        """Some answer had no ``weight_version`` at all."""
        self.malformed: set[str] = set()
        """Labels that are no version string (``5.0``, ``"5.0"``, ``true``, ...)."""
        self.base_replaced: set[str] = set()
        """Versions of full checkpoints an adapter ran on instead of SGLang's base model."""

    def add(self, group: list[Completion], required: int, latest: int | None) -> bool:
        """Record ``group``'s completions outside ``required .. latest``; whether there was one."""
        found = False
        for c in group:
            version, raw = c.weight_version, c.raw_weight_version
            if version is not None and required <= version and (latest is None or version <= latest):
                continue
            found = True
            if version is not None:
                (self.older if version < required else self.newer).add(str(version))
            elif raw is None:
                self.missing = True
            elif raw == SGLANG_START_VERSION:
                self.older.add(raw)
            elif BASE_REPLACED in raw:
                self.base_replaced.add(raw.split(BASE_REPLACED, 1)[1])
            else:
                self.malformed.add(raw)  # bounded where it is parsed (sglang_responses._raw_version)
        return found

    def labels(self) -> list[str]:
        """Every refused label, for the log ("missing" for an answer without one)."""
        replaced = {BASE_REPLACED.strip() + " " + v for v in self.base_replaced}
        return sorted(self.older | self.newer | self.malformed | replaced) + (["missing"] if self.missing else [])


def _some(values: set[str], most: int = 5) -> str:
    """Up to ``most`` of ``values``, sorted, and how many more (a message names a few, not thousands)."""
    first = sorted(values)[:most]
    return f"{first}" + (f" and {len(values) - most} more" if len(values) > most else "")
