"""The sidecar against a real SGLang server on the CPU: load, reject, recover, acknowledge."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from helpers import generate
from sidecar_helpers import assert_load_interval_inside_sync, perturbed_state, publish_step, transformers_greedy

PROMPT = [11, 42, 7, 99, 256, 3]


def weight_version(url: str) -> str:
    return httpx.get(f"{url}/model_info", timeout=30).json()["weight_version"]


def test_steps_load_in_order_and_serve_exactly_those_weights(
    sglang_server, sidecar_factory, checkpoint_root, tiny_model_dir
):
    sidecar = sidecar_factory()
    for step in (1, 2, 3):
        state = perturbed_state(tiny_model_dir, step)
        publish_step(checkpoint_root, tiny_model_dir, step, state)
        status = sidecar.wait_step(step)
        assert status["loaded_step"] == step
        out = generate(sglang_server.url, PROMPT, max_new_tokens=8, ignore_eos=True)
        assert out["meta_info"]["weight_version"] == str(step)
        assert out["output_ids"] == transformers_greedy(tiny_model_dir, state, PROMPT, 8), (
            f"SGLang's greedy output for step {step} differs from transformers on the same weights"
        )
    status = sidecar.status()
    assert status["last_sync"]["step"] == 3 and status["last_error"] is None
    assert_load_interval_inside_sync(status["last_sync"])
    assert sidecar.metric("rollout_sidecar_syncs_total", outcome="loaded", reason="ok") == 3
    # The ack file is written on a thread of its own just after /wait is answered (a slow root
    # never delays the answer): it follows within moments.
    deadline = time.monotonic() + 10
    while (ack := json.loads((checkpoint_root / "acks" / "r0.json").read_text()))["loaded_step"] != 3:
        assert time.monotonic() < deadline, ack
        time.sleep(0.05)
    assert ack["weight_version"] == "3"


@pytest.mark.parametrize("mode", ["inotify", "polling"])
def test_both_watch_modes_detect_publications(mode, sidecar_factory, checkpoint_root, tiny_model_dir):
    extra = ("--poll", "0.5") if mode == "polling" else ()
    sidecar = sidecar_factory(*extra)
    assert sidecar.status()["watch_mode"] == mode
    time.sleep(1.0)  # let the observer take its first snapshot
    publish_step(checkpoint_root, tiny_model_dir, 1)
    # Well inside the 30 s periodic rescan: only the watcher can make this in time.
    status = sidecar.wait_step(1, timeout_s=15)
    assert status["last_sync"]["detect_s"] is not None


def test_burst_during_load_ends_on_newest_without_failures(
    sglang_server, sidecar_factory, checkpoint_root, tiny_model_dir
):
    sidecar = sidecar_factory()
    # Published aside, then renamed in within microseconds: a burst faster than any load.
    side = checkpoint_root.parent / "side"
    paths = [publish_step(side, tiny_model_dir, step).path for step in range(1, 7)]
    for path in paths:
        os.rename(path, checkpoint_root / path.name)
    sidecar.wait_step(6)
    assert sidecar.status()["loaded_step"] == 6
    assert weight_version(sglang_server.url) == "6"
    loaded = sidecar.metric("rollout_sidecar_syncs_total", outcome="loaded", reason="ok")
    assert 1 <= loaded < 6, "a burst should coalesce into fewer loads than publications"
    text = sidecar.get("/metrics").text
    assert 'outcome="failed"' not in text and 'outcome="rejected"' not in text


def test_truncated_checkpoint_is_rejected_and_previous_keeps_serving(
    sglang_server, sidecar_factory, checkpoint_root, tiny_model_dir, tmp_path
):
    sidecar = sidecar_factory()
    publish_step(checkpoint_root, tiny_model_dir, 1)
    sidecar.wait_step(1)
    # Publish into a staging root, truncate there, then move it in atomically: no race.
    staged = publish_step(tmp_path / "staging", tiny_model_dir, 2).path
    shard = staged / "model.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    os.rename(staged, checkpoint_root / staged.name)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "2" not in sidecar.status()["rejected"]:
        time.sleep(0.3)
    status = sidecar.status()
    assert status["rejected"] == {"2": "truncated"}, status
    assert status["last_error"]["reason"] == "truncated" and "truncated" in status["last_error"]["message"]
    assert status["loaded_step"] == 1 and status["ready"] is True
    assert sidecar.metric("rollout_sidecar_syncs_total", outcome="rejected", reason="truncated") == 1
    assert httpx.get(f"{sglang_server.url}/health", timeout=30).status_code == 200
    assert generate(sglang_server.url, PROMPT, max_new_tokens=4)["meta_info"]["weight_version"] == "1"
    publish_step(checkpoint_root, tiny_model_dir, 3)
    sidecar.wait_step(3)


def test_wait_token_and_path_confinement(sidecar_factory, checkpoint_root, tiny_model_dir, tmp_path):
    sidecar = sidecar_factory("--token", "s3cret")
    r = sidecar.get("/wait?version=1&timeout=1")
    assert r.status_code == 504 and r.json()["waited_for"] == 1 and r.json()["loaded_step"] is None
    assert httpx.post(f"{sidecar.url}/sync", timeout=10).status_code == 401
    assert httpx.post(f"{sidecar.url}/sync", headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
    auth = {"Authorization": "Bearer s3cret"}
    for escape in ("../outside", "/etc", "step-00000001/../../x"):
        r = httpx.post(f"{sidecar.url}/sync", json={"checkpoint": escape}, headers=auth, timeout=10)
        assert r.status_code == 400 and r.json()["error"] == "path_escape", (escape, r.text)
    outside = tmp_path / "elsewhere"
    publish_step(outside, tiny_model_dir, 9)
    (checkpoint_root / "step-00000009").symlink_to(outside / "step-00000009")
    r = httpx.post(f"{sidecar.url}/sync", json={"checkpoint": "step-00000009"}, headers=auth, timeout=10)
    assert r.status_code == 400 and r.json()["error"] == "path_escape"
    (checkpoint_root / "step-00000009").unlink()
    waiter: dict = {}

    def wait_in_background():
        waiter["r"] = sidecar.get("/wait?version=1&timeout=120", timeout=150)

    t = threading.Thread(target=wait_in_background)
    t.start()
    publish_step(checkpoint_root, tiny_model_dir, 1)
    r = httpx.post(f"{sidecar.url}/sync", json={"checkpoint": "step-00000001"}, headers=auth, timeout=10)
    assert r.status_code == 202
    t.join(timeout=150)
    assert waiter["r"].status_code == 200 and waiter["r"].json()["loaded_step"] == 1


def test_generation_during_syncs_never_fails_or_goes_backwards(
    sglang_server, sidecar_factory, checkpoint_root, tiny_model_dir
):
    sidecar = sidecar_factory()
    publish_step(checkpoint_root, tiny_model_dir, 1)
    sidecar.wait_step(1)
    stop = threading.Event()
    seen: dict[int, list[int]] = {0: [], 1: []}
    errors: list[str] = []

    def client(i: int) -> None:
        while not stop.is_set():
            try:
                out = generate(
                    sglang_server.url, [PROMPT, PROMPT[::-1]], max_new_tokens=24, temperature=1.0, ignore_eos=True
                )
            except Exception as exc:  # any failure is a test failure
                errors.append(repr(exc))
                return
            for item in out:
                spans = item["meta_info"].get("weight_versions")
                versions = {span["version"] for span in spans or []}
                if len(versions) > 1:
                    errors.append(f"one completion spans versions {spans}")
                seen[i].append(int(item["meta_info"]["weight_version"]))

    threads = [threading.Thread(target=client, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for step in (2, 3, 4):
        time.sleep(0.5)
        publish_step(checkpoint_root, tiny_model_dir, step)
        sidecar.wait_step(step)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for versions in seen.values():
        assert versions and versions == sorted(versions), versions
    assert max(max(v) for v in seen.values()) == 4


def test_restarted_sidecar_converges_without_reloading(sglang_server, sidecar_factory, checkpoint_root, tiny_model_dir):
    first = sidecar_factory(replica_id="rx")
    publish_step(checkpoint_root, tiny_model_dir, 1)
    first.wait_step(1)
    first.kill(signal.SIGKILL)
    publish_step(checkpoint_root, tiny_model_dir, 2)
    second = sidecar_factory(replica_id="rx")
    second.wait_step(2)
    assert second.metric("rollout_sidecar_syncs_total", outcome="loaded", reason="ok") == 1
    third = sidecar_factory(replica_id="ry")  # beside a server that already serves step 2
    third.wait_step(2)
    time.sleep(2)
    assert third.metric("rollout_sidecar_syncs_total", outcome="loaded", reason="ok") == 0
    assert third.status()["ready"] is True
