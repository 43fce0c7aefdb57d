"""The sidecar's answers and state under untrusted input and load (a review of its HTTP API).

- An error quoting an untrusted name of any length (a tensor named by 100,000 characters) is
  cut: the ack file stays readable (else trainers count the replica dead) and ``/status`` small.
- ``/wait`` (no token needed) looks at the root through a gate of its own: clients waiting by the
  dozen on a slow root do not take the threads the ack heartbeat needs.
- A ``/wait`` held when the server stops answers 503 ``shutting_down``, not a 500.
- A long pass (validating a large or junk step) does not make ``/readyz`` call a serving
  replica unready while SGLang answers; an SGLang that came back on other weights is unready
  at once.

The SGLang here is a canned HTTP server (``FakeRoutes``): these are the sidecar's own answers
and state, and the real server cannot be made to answer slowly or change weights on cue.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from fake_sglang import FakeRoutes, dead_url
from rollout_service.checkpoint_format import MAX_ERROR_CHARS, CheckpointError
from rollout_service.checkpoint_reader import PublishedCheckpoint, read_model_specs, validate_checkpoint
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.protocol import MAX_ACK_BYTES, read_acks
from rollout_service.sidecar import controller as controller_module
from rollout_service.sidecar.app import create_app, http_server
from rollout_service.sidecar.controller import SyncController
from rollout_service.sidecar.root_gate import RootUnresponsive
from rollout_service.sidecar.settings import SidecarSettings
from rollout_service.sidecar.sync_record import SyncRecord

CONFIG = {"model_type": "qwen2", "hidden_size": 8}


def settings(root: Path, **overrides: Any) -> SidecarSettings:
    values: dict[str, Any] = {"sglang_url": dead_url(), "replica_id": "r0", "stage": False, **overrides}
    return SidecarSettings(checkpoint_path=root, **values)


def _tensors(extra: str | None = None) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = [("a.weight", torch.randn(8, 8, generator=g)), ("b.weight", torch.randn(8, generator=g))]
    return tensors + ([(extra, torch.zeros(1))] if extra else [])


def test_a_rejection_quoting_a_huge_tensor_name_keeps_the_ack_readable_and_status_small(tmp_path: Path) -> None:
    root = tmp_path / "root"
    publish_checkpoint(root, 1, _tensors(), config=CONFIG, run_id="run1")
    publish_checkpoint(root, 2, _tensors("x" * 100_000 + ".weight"), config=CONFIG, run_id="run1")
    with pytest.raises(CheckpointError) as caught:
        validate_checkpoint(
            root / "step-00000002", root=root, reference=read_model_specs(root / "step-00000001"), allow_float_cast=True
        )
    assert caught.value.reason == "extra_tensor"
    message = str(caught.value)
    assert "1 tensor(s) the reference lacks" in message and len(message) <= MAX_ERROR_CHARS + 3
    controller = create_app(settings(root)).state.controller
    controller._reject(PublishedCheckpoint(step=2, path=root / "step-00000002"), "extra_tensor", "y" * 200_000)
    controller.acks.write(controller.state.report())
    assert (root / "acks" / "r0.json").stat().st_size < MAX_ACK_BYTES
    assert read_acks(root)["r0"]["rejected"] == {"2": "extra_tensor"}
    assert len(json.dumps(controller.state.to_dict())) < 8192


def test_an_ack_too_large_for_readers_is_written_with_its_error_message_cut(tmp_path: Path) -> None:
    controller = create_app(settings(tmp_path)).state.controller
    controller.state.last_error = {"reason": "x", "message": "z" * (2 * MAX_ACK_BYTES), "step": 3, "at": 0.0}
    controller.acks.write(controller.state.report())
    ack = read_acks(tmp_path)["r0"]
    assert ack["last_error"]["reason"] == "x" and ack["last_error"]["message"].startswith("zzz")
    # The fatal condition (which the trainer's ack-file wait stops at) too: `serve` puts SGLang's
    # last log lines in its message.
    controller.state.fatal = {"reason": "restart_budget_spent", "message": "log " * MAX_ACK_BYTES}
    controller.acks.write(controller.state.report())
    ack = read_acks(tmp_path)["r0"]
    assert ack["fatal"]["reason"] == "restart_budget_spent" and ack["fatal"]["message"].startswith("log log")


def test_waits_on_a_slow_root_leave_the_loops_threads_free(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every /wait look hangs: the ack heartbeat's and the loop's looks still get a thread."""
    step = tmp_path / "step-00000005"
    step.mkdir()
    (step / "manifest.json").write_text("{}")
    release = threading.Event()

    def hung(path: Path) -> None:
        release.wait(30)
        return None

    monkeypatch.setattr(controller_module, "_rejection_identity", hung)
    controller = SyncController(settings(tmp_path, root_timeout_s=1.0))

    async def scenario() -> tuple[list[bool], Any]:
        controller._changed = asyncio.Condition()
        controller.state.rejected[5] = "bad_manifest"
        waits = [asyncio.create_task(controller.wait_for_step(5, 3.0)) for _ in range(12)]
        await asyncio.sleep(1.5)  # the looks are in flight, past their bound
        ack: RootUnresponsive | None = None
        try:
            await controller.root_gate.call(controller.acks.write, controller.state.report(), what="ack")
        except RootUnresponsive as exc:
            ack = exc
        release.set()
        return list(await asyncio.gather(*waits)), ack

    try:
        results, ack = asyncio.run(scenario())
    finally:
        release.set()
    assert ack is None, f"the ack writer found no thread: {ack}"
    assert results == [False] * 12  # the rejection stands (the looks did not answer)
    assert controller.root_gate.problem is None


def test_a_wait_held_at_shutdown_answers_503_shutting_down(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = http_server(create_app(settings(tmp_path, port=port)), settings(tmp_path, port=port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    answers: list[httpx.Response] = []
    waiter = threading.Thread(
        target=lambda: answers.append(httpx.get(f"http://127.0.0.1:{port}/wait?version=1&timeout=60", timeout=60))
    )
    waiter.start()
    time.sleep(1.0)
    server.should_exit = True
    waiter.join(30)
    thread.join(30)
    assert len(answers) == 1
    assert answers[0].status_code == 503 and answers[0].json()["error"] == "shutting_down"


def _pass_ready_controller(tmp_path: Path, sglang_url: str, pass_s: float) -> SyncController:
    """A controller whose next pass takes ``pass_s`` (validating a large step), SGLang healthy."""
    controller = SyncController(settings(tmp_path, sglang_url=sglang_url, health_interval_s=0.2))
    controller.state.sglang_healthy = True
    controller.state.sglang_seen_at = time.time()
    controller._was_healthy, controller._last_deep = True, time.monotonic()  # as the loop's check left it
    controller._reference = {}

    async def long_pass() -> None:
        await asyncio.sleep(pass_s)

    controller._sync_newest = long_pass  # type: ignore[method-assign]
    return controller


def test_sglang_answering_during_a_long_pass_stays_fresh_for_readiness(tmp_path: Path) -> None:
    sglang = FakeRoutes({"/model_info": (200, {"weight_version": "3", "model_path": "/m"}, 0.0)})
    try:
        controller = _pass_ready_controller(tmp_path, sglang.url, pass_s=4.0)
        asyncio.run(controller._sync_pass())
        assert controller.state.sglang_seen_at is not None
        assert time.time() - controller.state.sglang_seen_at < 1.5  # refreshed during the pass (fresh: 3 s)
    finally:
        sglang.close()


def test_sglang_silent_during_a_long_pass_goes_stale(tmp_path: Path) -> None:
    controller = _pass_ready_controller(tmp_path, dead_url(), pass_s=1.5)
    before = controller.state.sglang_seen_at
    asyncio.run(controller._sync_pass())
    assert controller.state.sglang_seen_at == before


def test_sglang_back_on_other_weights_makes_the_replica_unready_at_once(tmp_path: Path) -> None:
    sglang = FakeRoutes({"/model_info": (200, {"weight_version": "999", "model_path": "/m"}, 0.0)})
    try:
        controller = SyncController(settings(tmp_path, sglang_url=sglang.url))
        controller._was_healthy = True
        controller._last_deep = time.monotonic()
        controller._reference = {}
        state = controller.state
        state.loaded_step, state.ready, state.sglang_healthy = 3, True, True
        controller.metrics.ready.set(1)
        asyncio.run(controller._check_server())
        assert state.loaded_step is None
        assert state.ready is False and controller.readiness()[0] is False
        assert controller.metrics.ready._value.get() == 0
    finally:
        sglang.close()


def test_status_over_http_is_small_after_a_huge_rejection(tmp_path: Path) -> None:
    app = create_app(settings(tmp_path))
    app.state.controller._error("extra_tensor", "n" * 1_000_000, step=2)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert len(client.get("/status").content) < 8192


class _Manifest:
    """What ``_record_sync`` reads of a manifest."""

    run_id = "run"

    def source_fingerprint(self) -> str:
        return "fp"


def _metric_lines(client: TestClient) -> list[str]:
    return [
        line
        for line in client.get("/metrics").text.splitlines()
        if line.startswith(("rollout_sidecar_last_sync", "rollout_sidecar_detection_latency_seconds_count"))
    ]


def test_last_sync_metrics_describe_the_last_sync_alone(tmp_path: Path) -> None:
    app = create_app(settings(tmp_path))
    controller = app.state.controller
    first = SyncRecord(
        step=1, weight_version="1", path="/x/1", detect_s=0.4, validate_s=2.0, load_s=3.0, total_s=5.4,
        finished_at=time.time(), kind="full", bytes_read=10**9, apply_s=1.5,
    )  # fmt: skip
    again = SyncRecord(
        step=2,
        weight_version="2",
        path="/x/2",
        detect_s=None,
        validate_s=0.1,
        load_s=0.2,
        total_s=None,
        finished_at=time.time(),
        kind="full",
    )  # fmt: skip  (a step loaded before: no publish latencies; no stage: no bytes counted)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        controller._record_sync(_Manifest(), first)
        lines = _metric_lines(client)
        assert 'rollout_sidecar_last_sync_seconds{phase="detect"} 0.4' in lines
        assert "rollout_sidecar_last_sync_bytes_read 1e+09" in lines
        assert "rollout_sidecar_detection_latency_seconds_count 1.0" in lines
        controller._record_sync(_Manifest(), again)
        lines = _metric_lines(client)
    phases = {line.split('"')[1] for line in lines if line.startswith("rollout_sidecar_last_sync_seconds{")}
    assert phases == {"validate", "load"}  # as /status's last_sync: no detect, apply or total
    assert "rollout_sidecar_last_sync_bytes_read NaN" in lines
    assert "rollout_sidecar_detection_latency_seconds_count 1.0" in lines  # the reload is no detection


def test_detection_latency_and_adapter_bytes_come_from_the_loaded_syncs_record(tmp_path: Path) -> None:
    """Detection is observed from a sync that loaded (its record's ``detect_s``, made exact on
    whole-second file systems), not at each load attempt; an adapter's staged bytes count."""
    controller = SyncController(settings(tmp_path))
    controller._reject(PublishedCheckpoint(step=2, path=tmp_path / "step-00000002"), "sglang_rejected", "no")
    assert controller.metrics.detection_latency._sum.get() == 0
    controller.metrics.record_sync(
        SyncRecord(step=3, weight_version="3", path="/x", detect_s=0.25, validate_s=0.1, load_s=0.1,
                   total_s=0.5, finished_at=0.0, kind="adapter", bytes_read=1234)
    )  # fmt: skip
    assert controller.metrics.detection_latency._sum.get() == 0.25
    assert controller.metrics.synced_bytes.labels("adapter")._value.get() == 1234


@pytest.mark.parametrize(
    ("method", "url", "named"),
    [
        ("GET", "/wait?version=1&timout=5", "'timout'"),
        ("GET", "/status?verbose=1", "'verbose'"),
        ("POST", "/sync?checkpoint=../x", "'checkpoint'"),
        ("GET", "/readyz?x=1", "'x'"),
    ],
)
def test_an_unknown_query_parameter_is_refused_naming_it(tmp_path: Path, method: str, url: str, named: str) -> None:
    with TestClient(create_app(settings(tmp_path)), base_url="http://127.0.0.1") as client:
        r = client.request(method, url)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == "bad_request" and named in r.json()["detail"]


def test_known_query_parameters_still_work(tmp_path: Path) -> None:
    with TestClient(create_app(settings(tmp_path)), base_url="http://127.0.0.1") as client:
        r = client.get("/wait?version=1&timeout=0.2&run=abc")
    assert r.status_code == 504 and r.json()["error"] == "wait_timeout"


def test_a_sync_lookup_answers_within_its_bound_when_every_thread_is_busy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow (not hung) root: each look takes 0.7 s, the bound is 1 s. The ninth request waits
    for one of the eight threads; it must be answered within the bound, not after two of them."""
    from rollout_service.sidecar import app as app_module

    monkeypatch.setattr(app_module, "ROOT_LOOKUP_TIMEOUT_S", 1.0)
    app = create_app(settings(tmp_path))

    def slow(checkpoint: str) -> Path:
        time.sleep(0.7)
        return tmp_path / checkpoint

    monkeypatch.setattr(app.state.controller, "request_checkpoint", slow)

    async def scenario() -> list[int]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            posts = [client.post("/sync", json={"checkpoint": f"step-{i:08d}"}) for i in range(1, 10)]
            return [r.status_code for r in await asyncio.gather(*posts)]

    assert sorted(asyncio.run(scenario())) == [202] * 8 + [503]


def test_sglang_back_on_other_weights_during_a_long_pass_makes_the_replica_unready(tmp_path: Path) -> None:
    """The watch during a pass refreshes readiness only while SGLang serves what this replica
    loaded (or is loading): one restarted on its start-up weights is unready at once, and the
    step it held is no longer counted as served (see tests/test_sglang_lost_during_pass.py)."""
    sglang = FakeRoutes({"/model_info": (200, {"weight_version": "999", "model_path": "/m"}, 0.0)})
    try:
        controller = _pass_ready_controller(tmp_path, sglang.url, pass_s=1.5)
        state = controller.state
        state.loaded_step, state.ready = 3, True
        before = state.sglang_seen_at
        asyncio.run(controller._sync_pass())
        assert state.ready is False and state.loaded_step is None
        assert not controller.serves(3)
        state.loaded_step, before = 3, state.sglang_seen_at
        sglang.routes["/model_info"] = (200, {"weight_version": "3", "model_path": "/m"}, 0.0)
        asyncio.run(controller._sync_pass())
        assert state.sglang_seen_at is not None and state.sglang_seen_at > before
    finally:
        sglang.close()


@pytest.mark.parametrize(
    "answer",
    [
        (503, {"error": "shutting_down", "detail": "the sidecar is stopping"}),
        (503, {"error": "too_many_waits", "detail": "256 /wait requests are held already"}),
        (400, {"error": "bad_request", "detail": "unknown query parameter(s)"}),
    ],
)
def test_an_error_answer_to_wait_keeps_what_the_replica_last_reported_serving(answer: tuple[int, Any]) -> None:
    """Only a /status body (200, 504) says what a replica serves: an error's body, which names
    no step, must not clear it, or retention stops protecting the step the replica serves."""
    from fake_sglang import CannedServer, canned_reply
    from trainer_hooks.replica_wait import ReplicaSyncTimeout, SidecarWaiter

    status_body = {"replica_id": "r0", "loaded_step": 4, "error": "wait_timeout", "detail": "not yet"}
    sidecar = CannedServer(
        lambda path, body, count: canned_reply(504, status_body) if count == 1 else canned_reply(*answer)
    )
    waiter = SidecarWaiter([sidecar.url])
    try:
        with pytest.raises(ReplicaSyncTimeout):
            waiter.wait(5, timeout_s=1.5)
    finally:
        sidecar.stop()
    assert len(sidecar.requests) >= 2
    assert waiter.protected_versions() == {4}


def test_a_pass_ends_even_when_the_watch_misses_its_cancellation(tmp_path: Path) -> None:
    """Python 3.11's ``asyncio.wait_for`` (under every HTTP call) returns the call's answer instead
    of raising when a cancellation arrives as the call completes: the watch then went on polling
    SGLang and the pass waited for it for good (seen in CI: a sidecar stuck after SGLang
    restarted). Here the watch's call swallows every cancellation; the pass still ends."""
    from rollout_service.sidecar.sglang_client import ServerView

    controller = _pass_ready_controller(tmp_path, dead_url(), pass_s=0.5)
    calls: list[float] = []

    async def stubborn_view(deep: bool = False) -> ServerView:
        calls.append(time.monotonic())
        try:
            await asyncio.sleep(0.3)
        except asyncio.CancelledError:
            pass  # as wait_for does when its call has just completed
        return ServerView(healthy=True, weight_version=None)

    controller.client.view = stubborn_view  # type: ignore[method-assign]

    async def scenario() -> None:
        await asyncio.wait_for(controller._sync_pass(), 10)

    asyncio.run(scenario())
    assert calls  # the watch ran during the pass
