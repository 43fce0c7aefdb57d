"""Shared pytest fixtures: tiny local models and a real SGLang server on the CPU.

The server fixture starts `python -m sglang.launch_server` once per test session on the untied
tiny model; tests that use it are slow to set up (tens of seconds) but then fast.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fake_sglang import CannedServer, FakeRollout
from helpers import free_port as _free_port
from rollout_service.sglang_launcher import SGLangServer
from rollout_service.tiny_model import ensure_tiny_model

SERVER_HEALTH_TIMEOUT_S = 300.0
"""CI machines are slow (two cores shared with other jobs): SGLang may need minutes to start."""

SERVER_EXTRA_ARGS = ("--dtype", "float32")
"""SGLang's `--dtype auto` serves a float32 checkpoint as float16; the trainer and transformers
use float32, so the test server does too (greedy tokens and logprobs then agree with them)."""


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The cached untied tiny Qwen2 model folder (built on first use)."""
    return ensure_tiny_model(tied=False)


@pytest.fixture(scope="session")
def tiny_model_dir_tied() -> Path:
    """The cached tiny Qwen2 model folder with tied input/output embeddings."""
    return ensure_tiny_model(tied=True)


@pytest.fixture(scope="session")
def sglang_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    """A real SGLang server on the CPU serving the untied tiny model, shared by the session."""
    logging.getLogger("rollout_service").setLevel(logging.INFO)
    log_path = tmp_path_factory.mktemp("sglang") / "server.log"
    server = SGLangServer(
        tiny_model_dir,
        device="cpu",
        python=sys.executable,
        log_path=log_path,
        extra_args=SERVER_EXTRA_ARGS,
        die_with_parent=True,
    )
    server.start()
    try:
        server.wait_healthy(SERVER_HEALTH_TIMEOUT_S)
        yield server
    finally:
        server.stop()


@pytest.fixture
def checkpoint_root(tmp_path: Path) -> Path:
    """An empty folder for checkpoints, unique to the test."""
    root = tmp_path / "ckpts"
    root.mkdir()
    return root


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked."""
    return _free_port()


@pytest.fixture
def sglang_server_at_base(sglang_server: SGLangServer, tiny_model_dir: Path) -> SGLangServer:
    """The session server with the tiny model's own weights back in place (earlier tests may
    have loaded checkpoints into it), labelled with SGLang's start-up version "default"."""
    import httpx

    r = httpx.post(
        f"{sglang_server.url}/update_weights_from_disk",
        json={"model_path": str(tiny_model_dir), "weight_version": "default"},
        timeout=300,
    )
    assert r.status_code == 200 and r.json().get("success"), r.text
    return sglang_server


@pytest.fixture
def sidecar_factory(sglang_server, checkpoint_root, tmp_path):
    """Start `rollout-service sidecar` subprocesses beside the session server; stopped after."""
    from sidecar_helpers import Sidecar

    started: list = []

    def start(*extra: str, root=None, url=None, replica_id="r0"):
        sc = Sidecar(
            root or checkpoint_root,
            url or sglang_server.url,
            tmp_path / f"sidecar-{len(started)}.log",
            *extra,
            replica_id=replica_id,
        )
        started.append(sc)
        return sc

    yield start
    for sc in started:
        sc.stop()


@pytest.fixture
def fake() -> Iterator[FakeRollout]:
    """The in-process fake SGLang + sidecar (`fake_sglang.FakeRollout`), started and stopped after."""
    server = FakeRollout().start()
    yield server
    server.stop()


# --- markers: `pytest -m "not slow"` runs everything that starts no server in about a minute ----

SERVER_FIXTURES = frozenset(
    {
        "sglang_server",
        "sglang_server_at_base",
        "second_sglang_server",
        "sidecar_factory",
        "rollout_units",
        "untied_unit",
        "tied_unit",
        "serve_unit",
        "unit",
        "lora_server",
        "lora_sidecar",
        "lora_unit",  # tests/test_lora_sync.py, test_lora_grpo.py
    }
)
"""Fixtures that start a real SGLang server (and often a sidecar or `serve`)."""

SLOW_MODULES = frozenset(
    {
        "test_demo_learning",  # GRPO runs through `serve`
        "test_benchmarks",  # runs the benchmark scripts, which start SGLang
        "test_serve_and_replicas",  # `serve` subprocesses
        "test_lora_grpo",  # GRPO runs through `serve --lora` (and one without)
    }
)
"""Modules whose tests start SGLang, sidecars or training processes without those fixtures."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test that starts SGLang or a sidecar ``sglang`` and ``slow``."""
    for item in items:
        starts_server = bool(SERVER_FIXTURES & set(getattr(item, "fixturenames", ())))
        if starts_server:
            item.add_marker(pytest.mark.sglang)
        if starts_server or item.get_closest_marker("sglang") or item.module.__name__ in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def servers() -> Iterator[list[CannedServer]]:
    """Scripted servers (``fake_sglang.CannedServer``) a test starts; stopped after it."""
    made: list[CannedServer] = []
    yield made
    for server in made:
        server.stop()
