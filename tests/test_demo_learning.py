"""End to end: GRPO with SGLang rollouts and sidecar sync learns; the same run at lr 0 does not.

Both runs share one `rollout-service serve` unit and one checkpoint root (the second run's
versions continue above the first's), so this also proves a trainer restart on a used root.
"""

from __future__ import annotations

import json

import pytest

from trainer_hooks.demo import ServeProcess, run_demo

STEPS = 16


@pytest.fixture(scope="module")
def serve_unit(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("demo-unit")
    root = work / "ckpts"
    root.mkdir()
    unit = ServeProcess(tiny_model_dir, root, work / "serve.log", "cpu")
    try:
        unit.wait_ready(600)
        yield unit, root
    finally:
        unit.stop()


def test_reward_rises_with_learning_and_not_at_lr_zero(serve_unit, tmp_path):
    unit, root = serve_unit
    common = dict(steps=STEPS, sglang_url=unit.sglang_url, sidecar_url=unit.sidecar_url,
                  checkpoint_path=root, plot=True)
    learned = run_demo(tmp_path / "lr", learning_rate=1e-2, **common)
    control = run_demo(tmp_path / "lr0", learning_rate=0.0, **common)
    gain = learned["reward_last"] - learned["reward_first"]
    control_gain = control["reward_last"] - control["reward_first"]
    assert gain > 0.2, learned["rewards"]
    assert learned["reward_last"] > control["reward_last"] + 0.2, (learned["rewards"], control["rewards"])
    assert abs(control_gain) < 0.1, control["rewards"]
    # Every step synced and the rollouts were on-policy (strict staleness bound).
    versions = [v for v in learned["sync"]["sglang/sync_version"] if v is not None]
    assert len(versions) == STEPS and versions == sorted(versions)
    assert all(lag == 0 for lag in learned["sync"]["sglang/version_lag"] if lag is not None)
    summary = json.loads((tmp_path / "lr" / "summary.json").read_text())
    assert len(summary["rewards"]) == STEPS and (tmp_path / "lr" / "demo.png").stat().st_size > 0
    assert set(summary["time_split_median_s"]) >= {"generate", "sync_total", "train", "step"}


def _run_script(unit, root, out, *extra, processes: int = 1):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "grpo_run.py"
    # torchrun sets RANK/WORLD_SIZE; accelerate then runs MULTI_CPU with the gloo backend.
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(processes)]
    cmd = launcher + [str(script), "--sglang-url", unit.sglang_url, "--sidecar-url", unit.sidecar_url,
                      "--checkpoint-path", str(root), "--out", str(out), *extra]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(out.read_text())


def _status(unit):
    import httpx

    return httpx.get(f"{unit.sidecar_url}/status", timeout=30).json()


def test_two_training_processes_sync_through_the_sidecar(serve_unit, tmp_path):
    unit, root = serve_unit
    result = _run_script(unit, root, tmp_path / "ddp.json", "--steps", "3", processes=2)
    assert result["processes"] == 2
    versions = [h["sglang/sync_version"] for h in result["history"]]
    assert len(versions) == 3 and versions == sorted(versions)
    assert result["published_equals_trained"] and not result["unpublished_tensors"]
    assert _status(unit)["loaded_step"] == result["final_step"]


def test_peft_lora_run_publishes_merged_weights_that_sglang_loads(serve_unit, tmp_path):
    unit, root = serve_unit
    result = _run_script(unit, root, tmp_path / "peft.json", "--steps", "3", "--peft")
    versions = [h["sglang/sync_version"] for h in result["history"]]
    assert len(versions) == 3 and versions == sorted(versions)
    # Base names only (no lora_/base_layer tensors), equal to the merged trained model.
    assert not result["extra_published"] and not result["unpublished_tensors"], result
    assert result["published_equals_trained"], result["max_abs_diff"]
    status = _status(unit)
    assert status["loaded_step"] == result["final_step"] and not status["rejected"]
