"""A checkpoint root whose network file system stops answering (a real one: the sshd serving an
sshfs mount is frozen with SIGSTOP, so every look at the mount blocks in the kernel, as on a hung
NFS server). The sidecar must keep answering its API and checking SGLang, say why it is not
ready, answer ``/wait`` and ``POST /sync`` within their bounds, exit when told to, and pick up
new checkpoints once the root answers again."""

from __future__ import annotations

import signal
import subprocess
import time

import httpx
import pytest

from rollout_service.checkpoint_writer import publish_checkpoint
from shared_fs import server_frozen, sshfs_mount
from sidecar_helpers import perturbed_state

pytestmark = pytest.mark.sglang

ROOT_TIMEOUT_S = 2.0
QUICK_S = 5.0
"""Every answer of the sidecar while the root hangs comes within this (none waits on the root)."""


def publish_on_server(srv, model_dir, step):
    state = perturbed_state(model_dir, step)
    return publish_checkpoint(srv, step, state.items(), config=model_dir / "config.json", run_id="hung-run")


def quick_get(sidecar, path: str) -> httpx.Response:
    t0 = time.monotonic()
    r = httpx.get(sidecar.url + path, timeout=QUICK_S + 5)
    assert time.monotonic() - t0 < QUICK_S, f"{path} took {time.monotonic() - t0:.1f} s while the root hangs"
    return r


def test_a_hung_root_makes_the_replica_unready_with_a_reason_and_it_recovers(
    sglang_server, sidecar_factory, tiny_model_dir, tmp_path
):
    fs = tmp_path / "fs"
    with sshfs_mount(fs, "dcache_timeout=1", "attr_timeout=1") as (srv, mnt):
        sidecar = sidecar_factory("--poll", "0.5", "--root-timeout", str(ROOT_TIMEOUT_S), root=mnt, replica_id="hung")
        publish_on_server(srv, tiny_model_dir, 1)
        sidecar.wait_step(1, timeout_s=60)
        assert sidecar.get("/readyz").status_code == 200
        with server_frozen(fs):
            deadline = time.monotonic() + 30
            while True:
                ready = quick_get(sidecar, "/readyz")
                if ready.status_code == 503:
                    break
                assert time.monotonic() < deadline, f"still ready with a hung root: {ready.text}"
                time.sleep(0.3)
            assert ready.json()["reason"].startswith("root_unresponsive"), ready.json()
            assert str(mnt) in ready.json()["reason"]
            quick_get(sidecar, "/healthz").raise_for_status()
            seen = quick_get(sidecar, "/status").json()
            assert seen["root_problem"] and seen["loaded_step"] == 1
            assert seen["last_error"]["reason"] == "root_unresponsive"
            assert sidecar.metric("rollout_sidecar_root_responsive") == 0.0
            # SGLang is still checked: the health loop is not stuck behind the root (every 0.5 s;
            # a loaded CI machine once took over 2 s for SGLang's answer).
            deadline = time.monotonic() + 15
            while True:
                time.sleep(0.5)
                later = quick_get(sidecar, "/status").json()
                if (
                    later["sglang_seen_at"] > seen["sglang_seen_at"]
                    and later["loop_heartbeat"] > seen["loop_heartbeat"]
                ):
                    break
                assert time.monotonic() < deadline, (seen, later)
            assert later["sglang_healthy"] and later["root_problem"], later
            # /wait answers within the root's bound, not the 60 s asked for.
            waited = quick_get(sidecar, "/wait?version=1&timeout=60")
            assert waited.status_code == 504 and waited.json()["root_problem"]
            t0 = time.monotonic()
            named = httpx.post(f"{sidecar.url}/sync", json={"checkpoint": "step-00000002"}, timeout=QUICK_S + 5)
            assert time.monotonic() - t0 < QUICK_S
            assert named.status_code == 503 and named.json()["error"] == "root_unresponsive", named.text
            # The trainer goes on publishing on the server's side meanwhile.
            publish_on_server(srv, tiny_model_dir, 2)
            time.sleep(1.0)
            assert quick_get(sidecar, "/status").json()["loaded_step"] == 1
            # Threads stay bounded: the blocked look is not joined by one per pass.
            threads = int(
                subprocess.run(
                    ["ps", "-o", "nlwp=", "-p", str(sidecar.proc.pid)], capture_output=True, text=True
                ).stdout.split()[0]
            )
            assert threads < 40, f"{threads} threads in the sidecar while the root hangs"
        status = sidecar.wait_step(2, timeout_s=60)
        assert status["loaded_step"] == 2 and status["root_problem"] is None
        assert sidecar.metric("rollout_sidecar_root_responsive") == 1.0
        assert sidecar.get("/readyz").status_code == 200
        sidecar.stop()


def test_the_sidecar_shuts_down_promptly_while_its_root_hangs(sglang_server, sidecar_factory, tiny_model_dir, tmp_path):
    """Its own shutdown does not wait on the root. (The kernel reaps the process only once the
    threads blocked in the mount come back: a FUSE or hard NFS request cannot be abandoned.)"""
    fs = tmp_path / "fs"
    with sshfs_mount(fs, "dcache_timeout=1", "attr_timeout=1") as (srv, mnt):
        sidecar = sidecar_factory("--poll", "0.5", "--root-timeout", str(ROOT_TIMEOUT_S), root=mnt, replica_id="bye")
        publish_on_server(srv, tiny_model_dir, 1)
        sidecar.wait_step(1, timeout_s=60)
        with server_frozen(fs):
            time.sleep(3 * ROOT_TIMEOUT_S)  # the watcher's and the loop's looks are blocked by now
            assert "is not answering" in sidecar.log_tail(200)
            sidecar.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 20
            while "Finished server process" not in sidecar.log_tail(200):
                assert time.monotonic() < deadline, f"the sidecar's shutdown waits on the root:\n{sidecar.log_tail()}"
                time.sleep(0.2)
        assert sidecar.proc.wait(timeout=20) is not None  # the blocked looks came back: the process is gone
        assert "did not stop within" in sidecar.log_tail(200)


def test_a_sidecar_started_while_its_root_hangs_answers_and_loads_once_the_root_is_back(
    sglang_server, sidecar_factory, tiny_model_dir, tmp_path
):
    fs = tmp_path / "fs"
    with sshfs_mount(fs, "dcache_timeout=1", "attr_timeout=1") as (srv, mnt):
        publish_on_server(srv, tiny_model_dir, 1)
        with server_frozen(fs):
            time.sleep(2.5)  # past the mount's attribute caches (1 s): every look reaches the server
            # Its start-up checks of the root (a directory? the stage not inside it?) and its
            # watcher's first listing are bounded too: the API comes up (the factory waits for
            # /healthz) instead of hanging at start.
            sidecar = sidecar_factory(
                "--poll", "0.5", "--root-timeout", str(ROOT_TIMEOUT_S), root=mnt, replica_id="late"
            )
            deadline = time.monotonic() + 30
            while not (ready := quick_get(sidecar, "/readyz").json())["reason"].startswith("root_unresponsive"):
                assert time.monotonic() < deadline, ready
                time.sleep(0.3)
            assert ready["loaded_step"] is None
        status = sidecar.wait_step(1, timeout_s=60)
        assert status["loaded_run_id"] == "hung-run" and status["root_problem"] is None
        deadline = time.monotonic() + 10  # (ready at once since session 19; the bound names why not)
        while (ready := sidecar.get("/readyz")).status_code != 200:
            assert time.monotonic() < deadline, ready.json()
            time.sleep(0.3)
        log = sidecar.log_tail(300)
        assert "did not answer within --root-timeout" in log and "has not started within" in log
        sidecar.stop()


def test_a_client_naming_a_path_on_another_hung_file_system_is_refused_without_a_look(
    sglang_server, sidecar_factory, checkpoint_root, tiny_model_dir, tmp_path
):
    """POST /sync refuses a name that leaves the root as written, before looking anywhere: a
    path on some other, hung mount neither holds the request nor touches the replica's state."""
    fs = tmp_path / "fs"
    # A look at the hung mount would hold the request for the whole --root-timeout (or for ever,
    # unbounded), so a long one tells a look from none with a margin no loaded machine eats.
    root_timeout_s = 4 * QUICK_S
    sidecar = sidecar_factory("--token", "t0k", "--root-timeout", str(root_timeout_s))
    auth = {"Authorization": "Bearer t0k"}
    with sshfs_mount(fs) as (srv, mnt):
        publish_on_server(srv, tiny_model_dir, 1)
        with server_frozen(fs):
            time.sleep(2.5)  # past the mount's caches
            for name in (str(mnt / "step-00000001"), f"{checkpoint_root}/../fs/mnt/step-00000001"):
                t0 = time.monotonic()
                r = httpx.post(f"{sidecar.url}/sync", json={"checkpoint": name}, headers=auth, timeout=QUICK_S + 5)
                assert time.monotonic() - t0 < QUICK_S, f"{name}: {time.monotonic() - t0:.1f} s"
                assert r.status_code == 400 and r.json()["error"] == "path_escape", r.text
            local = publish_checkpoint(
                checkpoint_root,
                1,
                perturbed_state(tiny_model_dir, 1).items(),
                config=tiny_model_dir / "config.json",
                run_id="local-run",
            )
            r = httpx.post(f"{sidecar.url}/sync", json={"checkpoint": local.path.name}, headers=auth, timeout=10)
            assert r.status_code == 202, r.text
            assert sidecar.wait_step(1, timeout_s=60)["root_problem"] is None
    sidecar.stop()


def test_a_watcher_stopped_while_its_start_waits_on_a_hung_root_never_starts(tmp_path):
    from rollout_service.sidecar.watcher import CheckpointWatcher

    fs = tmp_path / "fs"
    seen: list[str] = []
    with sshfs_mount(fs, "dcache_timeout=1", "attr_timeout=1") as (srv, mnt):
        watcher = CheckpointWatcher(mnt, seen.append, poll_interval_s=0.2)
        with server_frozen(fs):
            time.sleep(2.5)  # past the mount's caches
            t0 = time.monotonic()
            watcher.start(timeout_s=0.5)
            watcher.stop(timeout_s=0.5)
            assert time.monotonic() - t0 < 3.0
        time.sleep(2.0)  # the blocked start comes back now: it must not start watching
        (srv / "step-00000001").mkdir()
        time.sleep(1.5)
        assert seen == [] and watcher._observer is None


def catch_validation(sidecar, step: int, timeout_s: float = 30.0) -> bool:
    """Wait until the sidecar validates ``step`` (True) or has loaded it already (False)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=10) as http:
        while True:
            seen = http.get(sidecar.url + "/status").json()
            if seen["loading_step"] == step:
                return True
            if seen["loaded_step"] == step:
                return False
            assert time.monotonic() < deadline, f"step {step} was never validated: {seen}"
            time.sleep(0.002)


def test_a_root_that_hangs_during_a_validation_does_not_cost_the_step(
    sglang_server, sidecar_factory, tiny_model_dir, tmp_path
):
    """A validation cut short by the root's file system (it stops answering while the step's
    files are read) ends in neither a rejection nor a lost step: the step is validated again and
    loaded once the root answers. Each try freezes the server as soon as the validation starts;
    one whose reads were already done loads at once, and the next step is tried."""
    validate_s = 3.0
    fs = tmp_path / "fs"
    with sshfs_mount(fs, "dcache_timeout=1", "attr_timeout=1") as (srv, mnt):
        sidecar = sidecar_factory(
            "--poll",
            "0.5",
            "--root-timeout",
            str(ROOT_TIMEOUT_S),
            "--validate-timeout",
            str(validate_s),
            root=mnt,
            replica_id="cut",
        )
        publish_on_server(srv, tiny_model_dir, 1)
        sidecar.wait_step(1, timeout_s=60)
        for step in range(2, 10):
            publish_on_server(srv, tiny_model_dir, step)
            if not catch_validation(sidecar, step):
                continue
            with server_frozen(fs):
                # Past the validation's own bound (+5 s) and a look at the root (its bound).
                time.sleep(validate_s + 5.0 + 2 * ROOT_TIMEOUT_S + 1.0)
                during = quick_get(sidecar, "/status").json()
            if during["loaded_step"] == step:
                continue  # the freeze came after the step's reads
            assert during["rejected"] == {}, during
            assert during["last_error"]["reason"] == "root_unresponsive", during["last_error"]
            assert f"not rejecting step {step} (validation_timeout" in sidecar.log_tail(300)
            break
        else:
            pytest.fail("no freeze landed inside a validation in 8 tries")
        status = sidecar.wait_step(step, timeout_s=60)
        assert status["loaded_step"] == step and status["rejected"] == {}, status
        assert sidecar.metric("rollout_sidecar_syncs_total", outcome="failed", reason="root_unresponsive") >= 1
        assert sidecar.metric("rollout_sidecar_syncs_total", outcome="rejected", reason="validation_timeout") == 0
        sidecar.stop()
