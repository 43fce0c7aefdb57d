"""The trainer closes what it opens: when ``train()`` ends or fails, the SGLang backend's HTTP
client, request threads and checkpoint worker are released, and a later call opens them again.

These run against the fake SGLang and sidecar (`fake_sglang.FakeRollout`, whose /wait acknowledges
any version). The failed run needs it: a real SGLang behind a real sidecar serves the published
weights, so it cannot be made to keep answering with SGLang's start-up version until
sync_timeout. The finished run and the reopened endpoints could run on a real server: a finished
run with background publishing through a real SGLang and sidecar is
test_grpo_through_sglang.py::test_background_sync_keeps_rollouts_within_max_staleness, which checks
what it trained on but not what it released. What these add is the release itself (threads, HTTP
client), which depends on nothing the server answers, so the fake keeps them in the fast runs.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from fake_sglang import FakeRollout
from trainer_helpers import make_config, make_trainer
from trainer_hooks.sglang_endpoints import SGLangEndpoints
from trainer_hooks.stale_retry import StaleWeightsError

BACKEND_THREADS = ("sglang-generate", "checkpoint-sync")
"""Name prefixes of the threads the backend starts (request pool, background publisher)."""


def _backend_threads(before: set[threading.Thread]) -> list[str]:
    """The backend's threads started since ``before`` that are still alive (given 5 s to exit)."""
    deadline = time.monotonic() + 5
    while True:
        alive = [t.name for t in threading.enumerate() if t not in before and t.name.startswith(BACKEND_THREADS)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def test_a_finished_training_releases_the_backend(tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout) -> None:
    # max_staleness=1: the checkpoints are published by the background worker thread.
    trainer = make_trainer(
        tiny_model_dir, make_config(tmp_path, tmp_path, [fake.url], [fake.url], max_steps=2, max_staleness=1)
    )
    before = set(threading.enumerate())
    started: list[str] = []
    original = trainer.vllm_generation.generate

    def generate(*args, **kwargs):  # TRL's own call, passed through
        out = original(*args, **kwargs)
        started.extend(t.name for t in threading.enumerate() if t not in before)
        return out

    trainer.vllm_generation.generate = generate
    trainer.train()
    assert any(name.startswith("sglang-generate") for name in started), started  # it did open them
    assert any(name.startswith("checkpoint-sync") for name in started), started
    assert _backend_threads(before) == []
    endpoints = trainer.vllm_generation.endpoints
    assert endpoints is not None and not endpoints.is_open


def test_a_failed_training_releases_the_backend_and_raises_its_own_error(
    tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout
) -> None:
    fake.fixed_version = "default"  # never the published weights: the step fails after sync_timeout
    trainer = make_trainer(tiny_model_dir, make_config(tmp_path, tmp_path, [fake.url], [fake.url], sync_timeout=2))
    before = set(threading.enumerate())
    with pytest.raises(StaleWeightsError):
        trainer.train()
    assert fake.generate_requests, "the backend never sent a request"
    assert _backend_threads(before) == []
    endpoints = trainer.vllm_generation.endpoints
    assert endpoints is not None and not endpoints.is_open


def test_closed_endpoints_open_again_on_the_next_request(fake: FakeRollout) -> None:
    endpoints = SGLangEndpoints([fake.url], request_timeout_s=10)
    assert not endpoints.is_open
    for _ in range(2):
        [[completion]] = endpoints.generate(
            [[7, 1]], {"n": 1, "max_new_tokens": 2}, want_logprobs=False, deadline=time.monotonic() + 10
        )
        assert completion.token_ids[0] == 7 and endpoints.is_open
        endpoints.close()
        assert not endpoints.is_open
    assert len(fake.generate_requests) == 2
