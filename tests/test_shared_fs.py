"""The sidecar on a real network file system (sshfs over loopback): the trainer writes on the
server side, the sidecar polls the mount (inotify sees nothing there), SGLang loads the
sidecar's verified stage copy, and a stale cached listing delays nothing the trainer names."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from helpers import generate
from rollout_service.checkpoint_writer import publish_checkpoint
from shared_fs import sshfs_mount
from sidecar_helpers import perturbed_state, transformers_greedy
from trainer_hooks.replica_wait import SidecarWaiter

pytestmark = pytest.mark.sglang

PROMPT = [11, 42, 7, 99, 256, 3]


def publish_on_server(srv, model_dir, step, state=None):
    state = perturbed_state(model_dir, step) if state is None else state
    return publish_checkpoint(srv, step, state.items(), config=model_dir / "config.json", run_id="nfs-run")


def test_polling_sidecar_on_sshfs_loads_what_the_trainer_writes_server_side(
    sglang_server, sidecar_factory, tiny_model_dir, tmp_path
):
    with sshfs_mount(tmp_path / "fs", "dcache_timeout=1", "attr_timeout=1") as (srv, mnt):
        sidecar = sidecar_factory("--poll", "0.5", root=mnt, replica_id="nfs")
        assert sidecar.status()["watch_mode"] == "polling"
        for step in (1, 2, 3):
            state = perturbed_state(tiny_model_dir, step)
            publish_on_server(srv, tiny_model_dir, step, state)
            status = sidecar.wait_step(step, timeout_s=60)  # no POST /sync: polling alone
            assert status["loaded_step"] == step and status["loaded_run_id"] == "nfs-run"
        served = httpx.get(f"{sglang_server.url}/model_info", timeout=30).json()["model_path"]
        assert not served.startswith(str(mnt)), "SGLang reads the stage copy, not the network mount"
        assert generate(sglang_server.url, PROMPT, max_new_tokens=8, ignore_eos=True)[
            "output_ids"
        ] == transformers_greedy(tiny_model_dir, state, PROMPT, 8)
        # A step damaged on the server is rejected over the mount; the last good one keeps serving.
        bad = publish_on_server(tmp_path / "side", tiny_model_dir, 4).path
        shard = bad / "model.safetensors"
        os.truncate(shard, shard.stat().st_size - 64)
        os.rename(bad, srv / bad.name)
        deadline = time.monotonic() + 60
        while "4" not in sidecar.status()["rejected"] and time.monotonic() < deadline:
            time.sleep(0.3)
        status = sidecar.status()
        assert status["rejected"] == {"4": "truncated"} and status["loaded_step"] == 3
        sidecar.stop()


def test_stale_cached_listing_does_not_delay_a_step_the_trainer_names(
    sglang_server, sidecar_factory, tiny_model_dir, tmp_path
):
    # Listings cached for a minute: the mount goes on showing the old contents of the root.
    with sshfs_mount(tmp_path / "fs", "dcache_timeout=60", "dcache_dir_timeout=60") as (srv, mnt):
        sidecar = sidecar_factory("--poll", "0.5", root=mnt, replica_id="stale")
        publish_on_server(srv, tiny_model_dir, 1)
        first = SidecarWaiter([sidecar.url])
        # Named, as the trainer does: the sidecar's first listing (of the empty root) may be
        # cached for the whole minute, so polling alone could not be relied on here.
        first.notify(1)
        first.wait(1, timeout_s=60)
        os.listdir(mnt)  # the client caches this listing
        publish_on_server(srv, tiny_model_dir, 2)
        assert "step-00000002" not in os.listdir(mnt), "the mount's cached listing should be stale"
        t0 = time.monotonic()
        waiter = SidecarWaiter([sidecar.url])
        waiter.notify(2)  # what the trainer does after each publication: POST /sync step-00000002
        waiter.wait(2, timeout_s=50)
        took = time.monotonic() - t0
        # Loaded while the mount still listed no step 2: the name the trainer sent, not polling, found it.
        assert "step-00000002" not in os.listdir(mnt), "the listing was still stale when step 2 loaded"
        status = sidecar.status()
        assert status["loaded_step"] == 2 and status["rejected"] == {}
        print(f"step 2 loaded {took:.2f} s after the trainer named it, through a stale listing")
        sidecar.stop()


def test_a_delta_chain_in_polling_mode_over_the_network_file_system(
    sglang_server, sidecar_factory, tiny_model_dir, tmp_path
):
    from delta_helpers import as_published, publish_chain

    with sshfs_mount(tmp_path / "fs", "dcache_timeout=1", "attr_timeout=1") as (srv, mnt):
        sidecar = sidecar_factory("--poll", "0.5", root=mnt, replica_id="nfs-delta")
        writer = None
        for step in (1, 2, 3, 4):
            writer, states = publish_chain(srv, tiny_model_dir, range(step, step + 1), writer=writer, run_id="nfs-run")
            last = sidecar.wait_step(step, timeout_s=60)["last_sync"]  # polling alone
            assert last["kind"] == ("full" if step == 1 else "delta")
            if step > 1:  # only the delta came over the mount
                assert last["bytes_read"] < 0.5 * sum(p.stat().st_size for p in (srv / "step-00000001").iterdir())
        assert generate(sglang_server.url, PROMPT, max_new_tokens=8, ignore_eos=True)[
            "output_ids"
        ] == transformers_greedy(tiny_model_dir, as_published(states[4]), PROMPT, 8)
        sidecar.stop()


def test_publish_times_are_exact_on_a_file_system_that_keeps_whole_seconds(tmp_path, tiny_model_dir):
    """SFTP carries whole seconds only, so sshfs reports a step's rename up to a second early:
    the sidecar's detect_s and total_s would be that much too long without the manifest's time."""
    from rollout_service.checkpoint_format import Manifest
    from rollout_service.sidecar.sync_record import SyncRecord, published_at

    with sshfs_mount(tmp_path / "fs") as (_, mnt):
        state = perturbed_state(tiny_model_dir, 1)
        errors = []
        for step in (1, 2, 3):
            result = publish_checkpoint(mnt, step, state.items(), config=tiny_model_dir / "config.json", run_id="r")
            done = time.time()
            st = result.path.stat()
            assert st.st_ctime_ns % 1_000_000_000 == 0, "sshfs kept sub-second times: this test lost its point"
            ctime = published_at(result.path)
            assert ctime is not None
            record = SyncRecord.ended_now(  # what the sidecar records for a load that ends now
                published=ctime,
                created_at=Manifest.load(result.path, root=mnt).created_at,
                detected=done,
                validate_s=0.0,
                load_s=0.0,
                step=step,
                weight_version=str(step),
                path=str(result.path),
            )
            assert record.total_s is not None
            when = record.finished_at - record.total_s
            errors.append(done - when)
            time.sleep(0.3)
        assert all(0 <= e < 0.25 for e in errors), errors
