"""End to end: GRPO with SGLang rollouts and sidecar sync learns; the same run at lr 0 does not.

Both runs share one `rollout-service serve` unit and one checkpoint root (the second run's
versions continue above the first's), so this also proves a trainer restart on a used root.
"""

from __future__ import annotations

import json

import pytest

from rollout_demo.demo import ServeProcess, run_demo

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
    common = dict(
        steps=STEPS, sglang_url=unit.sglang_url, sidecar_url=unit.sidecar_url, checkpoint_path=root, plot=True
    )
    # 2e-2 (the demo's default): reward ~1.0 by step 16 in 3 of 3 probe runs; at 1e-2 the climb
    # sometimes starts late (one CI run: 0.34 -> 0.48 in 16 steps), SGLang's sampling being unseeded.
    learned = run_demo(tmp_path / "lr", learning_rate=2e-2, **common)
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


def _run_script(unit, root, out, *extra, processes: int = 1, script: str = "grpo_run.py"):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / script
    # torchrun sets RANK/WORLD_SIZE; accelerate then runs MULTI_CPU with the gloo backend.
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    cmd = launcher + [
        str(script),
        "--sglang-url",
        unit.sglang_url,
        "--sidecar-url",
        unit.sidecar_url,
        "--checkpoint-path",
        str(root),
        "--out",
        str(out),
        *extra,
    ]
    os = __import__("os")
    # The checkout's packages, as pytest's `pythonpath` gives this process (rollout_demo included).
    repo = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p),
    }
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


def test_deepspeed_zero3_run_gathers_partitioned_weights_that_sglang_loads(serve_unit, tmp_path):
    # TRL's GRPOTrainer under accelerate's DeepSpeed plugin, ZeRO stage 3 on 2 CPU processes.
    unit, root = serve_unit
    result = _run_script(unit, root, tmp_path / "zero3.json", "--steps", "3", "--zero3", processes=2)
    assert result["processes"] == 2 and result["distributed_type"] == "DistributedType.DEEPSPEED"
    # Every parameter is partitioned (empty locally), so a sync must gather each one.
    assert result["partitioned_parameters"] == result["parameters"] > 0
    versions = [h["sglang/sync_version"] for h in result["history"]]
    assert len(versions) == 3 and versions == sorted(set(versions))  # one new version per step
    assert result["published_equals_trained"] and not result["unpublished_tensors"], result["max_abs_diff"]
    status = _status(unit)
    assert status["loaded_step"] == result["final_step"] and not status["rejected"]


def test_fsdp2_sharded_model_publishes_full_weights_that_sglang_serves(serve_unit, tmp_path):
    # accelerate runs FSDP on GPU-like devices only, so the model is sharded with FSDP2's own
    # fully_shard (as accelerate's FSDP2 plugin does) and synced by SGLangGeneration directly.
    unit, root = serve_unit
    result = _run_script(unit, root, tmp_path / "fsdp2.json", "--steps", "2", processes=2, script="fsdp2_sync.py")
    assert result["processes"] == 2 and result["sharded"]
    checks = result["checks"]
    assert [c["step"] for c in checks] == sorted({c["step"] for c in checks}) and len(checks) == 2
    for check in checks:
        # Several shards, every tensor unsharded and equal to the gathered trained weights.
        assert check["shards"] > 1 and not check["missing"] and not check["extra"], check
        assert check["published_equals_trained"], check["max_abs_diff"]
        # The rollouts right after each sync came from exactly that version.
        assert check["served_versions"] == [check["step"]] and check["completions"] == 2
    assert _status(unit)["loaded_step"] == checks[-1]["step"]


def _tldr_rows(n: int) -> list[dict[str, str]]:
    topics = ["my cat", "the rent", "a new job", "our trip", "his bike", "the exam"]
    return [
        {
            "prompt": f"SUBREDDIT: r/advice\nTITLE: about {topics[i % 6]}\nPOST: I worry about {topics[i % 6]} "
            f"every day and ask what to do.\nTL;DR:",
            "completion": f" worried about {topics[i % 6]}",
        }
        for i in range(n)
    ]


def _example_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "examples" / "grpo_tldr_gpu.py"
    spec = importlib.util.spec_from_file_location("grpo_tldr_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rouge_reward_reads_the_reference_summary_column():
    reward = _example_module().rouge_l_reward()
    scores = reward(
        ["worried about my cat", "bananas", "worried about rent"],
        reference_summary=["worried about my cat", "worried about my cat", "worried about the rent"],
    )
    assert scores[0] == 1.0 and scores[1] == 0.0 and 0.0 < scores[2] < 1.0


def test_gpu_example_runs_on_cpu_with_a_local_tldr_dataset(serve_unit, tmp_path, tiny_model_dir):
    # The GPU example, as documented, with the tiny model and a local file in trl-lib/tldr's format.
    import subprocess
    import sys
    from pathlib import Path

    unit, root = serve_unit
    data = tmp_path / "tldr.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in _tldr_rows(24)))
    script = Path(__file__).parents[1] / "examples" / "grpo_tldr_gpu.py"
    cmd = [
        sys.executable,
        str(script),
        "--model",
        str(tiny_model_dir),
        "--dataset",
        str(data),
        "--checkpoint-path",
        str(root),
        "--sglang-url",
        unit.sglang_url,
        "--sidecar-url",
        unit.sidecar_url,
        "--output-dir",
        str(tmp_path / "out"),
        "--max-steps",
        "2",
        "--per-device-train-batch-size",
        "4",
        "--num-generations",
        "4",
        "--max-completion-length",
        "8",
        "--learning-rate",
        "1e-3",
    ]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    # One log line per step (logging_steps=1 for short runs), with the ROUGE reward and a sync.
    logged = [line for line in done.stdout.splitlines() if "'rewards/rouge_l/mean'" in line]
    assert len(logged) == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert all("'sglang/sync_version'" in line for line in logged), logged
    last_version = float(logged[-1].split("'sglang/sync_version': '")[1].split("'")[0])
    status = _status(unit)
    assert status["loaded_step"] == last_version and not status["rejected"]


def test_gpu_example_names_a_dataset_without_the_tldr_columns(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"text": "no prompt here"}) + "\n")
    script = Path(__file__).parents[1] / "examples" / "grpo_tldr_gpu.py"
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            "--model",
            "unused",
            "--dataset",
            str(data),
            "--checkpoint-path",
            str(tmp_path / "c"),
            "--sglang-url",
            "http://127.0.0.1:9",
            "--sidecar-url",
            "http://127.0.0.1:9",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    assert "missing column(s) ['completion', 'prompt']" in done.stderr, done.stderr[-2000:]
