"""`rollout-service serve` as a supervised unit, and two replicas sharing one checkpoint root."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch

from helpers import free_port, generate
from rollout_service.sglang_launcher import SGLangServer
from sidecar_helpers import CLIProcess, Sidecar, perturbed_state, publish_step, serve_argv, wait_http

STARTUP_S = 400.0


def sglang_children(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True) if "sglang.launch_server" in " ".join(p.cmdline())]


def test_serve_restarts_a_killed_sglang_and_reapplies_the_newest_checkpoint(tiny_model_dir, checkpoint_root, tmp_path):
    port, sidecar_port = free_port(), free_port()
    # The key is given once, to the sidecar: serve starts SGLang with it (SGLang then refuses
    # anyone else's weight updates), and the sidecar's own loads carry it.
    key = "serve-test-sglang-key"
    serve = CLIProcess(
        serve_argv(tiny_model_dir, checkpoint_root, port, sidecar_port, "served"),
        tmp_path / "serve.log",
        env={"ROLLOUT_SGLANG_API_KEY": key},
    )
    with_key = {"Authorization": f"Bearer {key}"}
    sidecar = f"http://127.0.0.1:{sidecar_port}"
    sglang = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{sidecar}/readyz", STARTUP_S, serve)
        # The first checkpoint is checked against the served model: resized embeddings never
        # reach SGLang (in 0.5.23 loading them kills the scheduler).
        resized = perturbed_state(tiny_model_dir, 1)
        embed = resized["model.embed_tokens.weight"]
        resized["model.embed_tokens.weight"] = torch.cat([embed, torch.zeros(8, embed.shape[1])])
        publish_step(checkpoint_root, tiny_model_dir, 1, resized)
        r = httpx.get(f"{sidecar}/wait?version=1&timeout=60", timeout=90)
        assert r.status_code == 504 and r.json()["rejected"] == {"1": "shape_mismatch"}, r.text
        assert httpx.get(f"{sglang}/health", timeout=60).status_code == 200
        assert "restart 1 of" not in serve.log_path.read_text()
        unkeyed = httpx.post(f"{sglang}/update_weights_from_disk", json={"model_path": str(tmp_path)}, timeout=60)
        assert unkeyed.status_code == 401, unkeyed.text
        shutil.rmtree(checkpoint_root / "step-00000001")
        publish_step(checkpoint_root, tiny_model_dir, 1)
        assert httpx.get(f"{sidecar}/wait?version=1&timeout=120", timeout=150).status_code == 200
        [leader] = [p for p in sglang_children(serve.proc.pid) if p.pid == os.getpgid(p.pid)] or sglang_children(
            serve.proc.pid
        )[:1]
        os.killpg(os.getpgid(leader.pid), signal.SIGKILL)
        wait_http(f"{sidecar}/readyz", 60, serve, status=503)
        wait_http(f"{sidecar}/readyz", STARTUP_S, serve)
        status = httpx.get(f"{sidecar}/status", timeout=30).json()
        assert status["loaded_step"] == 1 and status["sglang_weight_version"] == "1"
        r = httpx.post(
            f"{sglang}/generate",
            json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
            headers=with_key,
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["meta_info"]["weight_version"] == "1", r.text
        assert key not in serve.log_path.read_text()  # SGLang's command line is logged with the key hidden
        metrics = httpx.get(f"{sidecar}/metrics", timeout=30).text
        assert "rollout_sidecar_sglang_restarts_total 1.0" in metrics
        assert "restart 1 of 5" in serve.log_path.read_text()
        children = [p.pid for p in psutil.Process(serve.proc.pid).children(recursive=True)]
    finally:
        serve.kill(signal.SIGTERM)
    assert serve.proc.returncode == 0, serve.log_tail()
    time.sleep(1)
    alive = [pid for pid in children if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"serve left processes behind: {alive}"


@pytest.fixture(scope="module")
def second_sglang_server(tiny_model_dir, tmp_path_factory):
    server = SGLangServer(
        tiny_model_dir,
        device="cpu",
        python=sys.executable,
        log_path=tmp_path_factory.mktemp("sglang2") / "server.log",
        die_with_parent=True,
    )
    server.start()
    try:
        server.wait_healthy(STARTUP_S)
        yield server
    finally:
        server.stop()


def test_two_replicas_load_and_acknowledge_every_step(
    sglang_server, second_sglang_server, checkpoint_root, tiny_model_dir, tmp_path
):
    a = Sidecar(checkpoint_root, sglang_server.url, tmp_path / "a.log", replica_id="replica-a")
    b = Sidecar(checkpoint_root, second_sglang_server.url, tmp_path / "b.log", replica_id="replica-b")
    try:
        for step in (1, 2, 3):
            publish_step(checkpoint_root, tiny_model_dir, step)
            for sidecar, server in ((a, sglang_server), (b, second_sglang_server)):
                assert sidecar.wait_step(step)["loaded_step"] == step
                out = generate(server.url, [1, 2, 3], max_new_tokens=2)
                assert out["meta_info"]["weight_version"] == str(step)
            # A sidecar writes its ack file just after /wait answers: give the second one a moment.
            want, deadline = {"replica-a": step, "replica-b": step}, time.monotonic() + 10
            while True:
                acks = {p.stem: json.loads(p.read_text()) for p in (checkpoint_root / "acks").glob("*.json")}
                found = {k: v["loaded_step"] for k, v in acks.items()}
                if found == want or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert found == want
        for sidecar in (a, b):
            assert sidecar.metric("rollout_sidecar_syncs_total", outcome="loaded", reason="ok") == 3
    finally:
        a.stop()
        b.stop()


def test_two_replicas_stage_and_rebuild_deltas_independently(
    sglang_server, second_sglang_server, checkpoint_root, tiny_model_dir, tmp_path
):
    from delta_helpers import as_published, publish_chain
    from sidecar_helpers import transformers_greedy

    a = Sidecar(checkpoint_root, sglang_server.url, tmp_path / "a.log", replica_id="delta-a")
    b = Sidecar(checkpoint_root, second_sglang_server.url, tmp_path / "b.log", replica_id="delta-b")
    try:
        writer = None
        for step in (1, 2, 3):
            writer, states = publish_chain(checkpoint_root, tiny_model_dir, range(step, step + 1), writer=writer)
            for sidecar in (a, b):
                last = sidecar.wait_step(step)["last_sync"]
                assert last["step"] == step and last["kind"] == ("full" if step == 1 else "delta")
        stages = {Path(s.status()["last_sync"]["path"]).parent for s in (a, b)}
        assert len(stages) == 2, "each replica rebuilds in its own stage"
        want = transformers_greedy(tiny_model_dir, as_published(states[3]), [1, 2, 3], 6)
        for server in (sglang_server, second_sglang_server):
            assert generate(server.url, [1, 2, 3], max_new_tokens=6, ignore_eos=True)["output_ids"] == want
    finally:
        a.stop()
        b.stop()


def test_grpo_spreads_rollouts_over_two_real_servers_and_skips_a_dead_one(
    sglang_server, second_sglang_server, checkpoint_root, tiny_model_dir, tmp_path, caplog
):
    import logging

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer_hooks import GRPOConfig, GRPOTrainer

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused
    a = Sidecar(checkpoint_root, sglang_server.url, tmp_path / "a.log", replica_id="replica-a")
    b = Sidecar(checkpoint_root, second_sglang_server.url, tmp_path / "b.log", replica_id="replica-b")
    try:
        args = GRPOConfig(
            output_dir=str(tmp_path / "out"),
            checkpoint_path=str(checkpoint_root),
            sglang_urls=[sglang_server.url, dead, second_sglang_server.url],
            sidecar_urls=[a.url, b.url],
            report_to="none",
            use_cpu=True,
            bf16=False,
            num_generations=4,
            per_device_train_batch_size=12,
            max_completion_length=6,
            max_steps=2,
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            sync_timeout=300.0,
            seed=0,
        )
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
            reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": [f"count to {i}" for i in range(16)]}),
            processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        )
        with caplog.at_level(logging.WARNING, logger="trainer_hooks"):
            trainer.train()
        endpoints = trainer.vllm_generation.endpoints
        assert endpoints is not None
        answered = endpoints.prompts_answered()
        # 3 unique prompts per step (one per endpoint), 2 steps: the live servers answered all.
        assert answered[dead] == 0 and sum(answered.values()) == 6, answered
        assert answered[sglang_server.url] > 0 and answered[second_sglang_server.url] > 0, answered
        assert f"SGLang endpoint {dead} failed" in caplog.text
        # Each step's rollouts came from the version both replicas acknowledged.
        for record in trainer.vllm_generation.history:
            assert set(record.versions) == {record.published_version}, record
        assert a.status()["loaded_step"] == b.status()["loaded_step"] == record.published_version
    finally:
        a.stop()
        b.stop()
