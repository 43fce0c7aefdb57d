"""A warning for the one set-up that slows training down many times over: a CPU-only trainer on
every core beside a local SGLang that busy-polls.

The trainer calls :func:`warn_if_sharing_the_cpu` once at start-up, on the main process.
"""

from __future__ import annotations

import logging
import os

import torch

from rollout_service.http_auth import is_loopback_url

from .sglang_endpoints import SGLangEndpoints

log = logging.getLogger(__name__)


def warn_if_sharing_the_cpu(endpoints: SGLangEndpoints) -> bool:
    """Warn (and return True) when a CPU-only trainer uses every core beside a local SGLang that
    busy-polls.

    SGLang's CPU scheduler keeps a core busy even when idle unless it runs with
    ``--sleep-on-idle`` (``rollout-service serve`` and the launcher pass it on CPU); a trainer
    whose torch threads use every core then waits on its own descheduled threads (measured on
    2 cores: TRL's step 0.34 s -> 6.5 s with an idle busy-polling server beside it).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if torch.cuda.is_available() or torch.get_num_threads() < cores:
        return False
    polling = [u for u in endpoints.urls if is_loopback_url(u) and endpoints.sleeps_on_idle(u) is not True]
    if not polling:
        return False
    log.warning(
        "SGLang at %s runs on this machine's CPU, may busy-poll a core while idle, and the trainer uses "
        "all %d cores: training can slow down many times over. Start SGLang with --sleep-on-idle (as "
        "`rollout-service serve` does on CPU) or call torch.set_num_threads(%d) before training",
        ", ".join(polling),
        cores,
        max(1, cores // 2),
    )
    return True
