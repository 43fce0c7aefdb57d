"""The benchmark scripts still run and report every figure they promise (smallest settings).

These are smoke runs against the real SGLang server on the CPU, not measurements: they check
that each phase, baseline and ratio is produced and self-consistent, never how fast anything is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "benchmarks"


def _run(cmd: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **env}
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def _tiny_sync_bench(tmp_path: Path, storage: Path, *flags: str) -> tuple[dict, subprocess.CompletedProcess]:
    """One repeat of ``sync_bench.py`` on the tiny model with real SGLang: (its one result, the run)."""
    out = tmp_path / "sync.json"
    done = _run(
        [sys.executable, str(BENCH / "sync_bench.py"), "--sizes", "tiny", "--storage", str(storage)]
        + ["--repeats", "1", "--warmup", "0", *flags, "--log-dir", str(tmp_path / "logs"), "--json", str(out)],
        timeout=900,
    )
    [result] = json.loads(out.read_text())["results"]
    return result, done


def test_sync_bench_reports_every_phase_and_both_baselines(tmp_path: Path) -> None:
    result, done = _tiny_sync_bench(tmp_path, tmp_path)
    assert result["error"] is None and result["sglang"] and result["tensors"] > 0
    med = result["median_s"]
    phases = ["publish_s", "detect_s", "validate_s", "load_s", "ack_s", "end_to_end_s"]
    assert all(med[f"ours.{p}"] >= 0 for p in phases)
    # End to end covers the publish and everything the sidecar did after it.
    assert med["ours.end_to_end_s"] >= med["ours.publish_s"]
    assert med["physical.limit_s"] > 0 and med["naive.total_s"] > 0
    ratios = result["ratios"]
    assert abs(ratios["ours/limit"] - med["ours.end_to_end_s"] / med["physical.limit_s"]) < 1e-9
    assert abs(ratios["ours/naive"] - med["ours.end_to_end_s"] / med["naive.total_s"]) < 1e-9
    assert "Against the physical limit and the naive path" in done.stdout
    # Staged (the default) and direct loads measured side by side: what closing the window costs.
    assert all(med[f"ours_nostage.{p}"] >= 0 for p in phases)
    assert abs(ratios["ours/ours_nostage"] - med["ours.end_to_end_s"] / med["ours_nostage.end_to_end_s"]) < 1e-9
    assert "What verified staging costs" in done.stdout
    # SGLang's own floor: the copy it serves loaded again by a bare call, with the probe running
    # (not for the direct path, which has no staged copy of its own).
    assert med["ours.bare_load_s"] > 0 and med["ours.bare_idle_probe_s"] > 0
    assert abs(ratios["full bare_pause/load"] - med["ours.bare_pause_s"] / med["ours.bare_load_s"]) < 1e-9
    assert "ours_nostage.bare_load_s" not in med


def test_sync_bench_delta_times_both_paths_on_the_same_weights(tmp_path: Path) -> None:
    """--delta: today's full path and the delta path publish the same trainer's weights (the
    tiny model's fp32 master copy, cast to bf16 by each publisher inside its timed sync), so a
    full checkpoint has the same bytes on both; the full path once got the model as it was."""
    result, done = _tiny_sync_bench(tmp_path, tmp_path / "storage", "--delta", "--skip-naive", "--no-probe")
    assert result["error"] is None, result["error"]
    [full], [delta] = result["runs"]["ours"], result["runs"]["ours_delta"]
    assert delta["delta"] and delta["bytes_written"] < delta["full_bytes"]
    assert full["full_bytes"] == full["bytes_written"] == delta["full_bytes"]  # bf16 on both paths
    # The same warm-up for both paths (at least the delta chain's full start), one timed sync each.
    assert full["warmup_syncs"] == delta["warmup_syncs"] >= 1
    # The delta path's physical limit, with that run's delta bytes and SGLang's load.
    [limit] = result["runs"]["delta_limit"]
    assert abs(limit["limit_with_load_s"] - limit["limit_s"] - delta["load_s"]) < 1e-9
    ratios, med = result["ratios"], result["median_s"]
    assert abs(ratios["delta/limit-delta"] - med["ours_delta.end_to_end_s"] / limit["limit_with_load_s"]) < 1e-9
    assert "Delta sync" in done.stdout


def test_pause_is_measured_against_an_idle_baseline() -> None:
    """The probe's arithmetic (``benchmarks/measures.py``): the longest probe overlapping a
    window less the idle median, and how long probes were in flight over the load interval."""
    sys.path.insert(0, str(BENCH))
    import measures

    idle = measures.idle_baseline([0.10, 0.12, 0.11, 0.50])
    assert idle is not None and abs(idle - 0.115) < 1e-12
    spans = [(0.0, 0.1), (0.1, 0.9), (0.9, 1.0), (2.0, 2.1)]
    assert measures.pause_over(spans, 0.5, 1.5, idle) == 0.8 - idle  # the 0.8 s probe overlapped
    assert measures.pause_over(spans, 1.2, 1.8, idle) is None  # no probe in flight then
    assert measures.pause_over(spans, 0.0, 3.0, None) is None  # no baseline, no pause
    assert measures.pause_over([(0.0, 0.05)], 0.0, 1.0, idle) == 0.0  # faster than idle: no pause
    assert abs(measures.overlap_seconds(spans, 0.5, 2.05) - (0.4 + 0.1 + 0.05)) < 1e-12
    # Only probes sent inside the window: the 0.8 s one was sent before 0.5, so it is not the load's.
    assert measures.pause_started_in(spans, 0.5, 1.5, idle) == 0.0  # the one sent at 0.9 took 0.1 s
    assert measures.pause_started_in(spans, 0.05, 1.5, idle) == 0.8 - idle  # sent at 0.1: inside
    assert measures.pause_started_in(spans, 1.2, 1.8, idle) is None  # none sent then
    # The spans kept beside a load: those within the margin, in seconds from the load's start.
    assert measures.spans_near(spans, 1.0, 1.2, margin=0.5) == [(-0.9, -0.1), (-0.1, 0.0)]
    assert measures.spans_near(spans, 1.0, 1.6, margin=0.5) == [(-0.9, -0.1), (-0.1, 0.0), (1.0, 1.1)]


def test_physical_limits_time_every_part(tmp_path: Path) -> None:
    """The limits write, fsync and read back the bytes (both ways, the faster counting) and
    write the model into the stage's file system; nothing is left behind."""
    sys.path.insert(0, str(BENCH))
    import measures

    path = tmp_path / "f"
    assert measures.write_fsync(path, 3 << 20) > 0 and path.stat().st_size == 3 << 20
    read = measures.read_back(path)
    assert read["read_s"] == min(read["read_copy_s"], read["read_mmap_s"]) > 0
    stage = tmp_path / "stage-fs"
    limit = measures.delta_limit(tmp_path, 1 << 20, stage, 5 << 20)
    parts = limit["delta_write_fsync_s"] + limit["delta_read_s"] + limit["stage_write_s"]
    assert abs(limit["limit_s"] - parts) < 1e-12 and all(v > 0 for v in limit.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "stage-fs"] and not list(stage.iterdir())


def _dry_run(script: str, results: Path, **env: str) -> subprocess.CompletedProcess:
    """A GPU script run on the CPU with this Python, its results under ``results``."""
    return _run(["bash", str(BENCH / script)], timeout=600, OUT=str(results), ROLLOUT_GPU_PYTHON=sys.executable, **env)


def test_gpu_check_dry_runs_on_the_cpu_with_its_fallback(tmp_path: Path) -> None:
    # GPU_CHECK_DEVICE=cpu is the script's dry-run switch; without SGLang's CUDA kernels it takes
    # its trainer-side fallback, as on a GPU machine without SGLang.
    results = tmp_path / "results"
    done = _dry_run("gpu_check.sh", results, GPU_CHECK_DEVICE="cpu", GPU_CHECK_SIZES="tiny", GPU_CHECK_REPEATS="1")
    log = (results / "gpu-check.log").read_text()
    assert "trainer side only (--no-sglang)" in log and "size tiny finished with exit code 0" in log, log[-3000:]
    measured = json.loads((results / "sync-tiny.json").read_text())["results"]
    assert measured and {r["storage"] for r in measured} <= {"local", "shm"}  # one result per storage
    for result in measured:
        assert result["error"] is None and not result["sglang"] and result["median_s"]["ours.publish_s"] > 0
    assert (results / "env.txt").exists() and (results / "logs.tar.gz").exists()
    assert "done in" in done.stdout


def test_gpu_delta_check_dry_runs_on_the_cpu_and_reports_a_delta_beside_full(tmp_path: Path) -> None:
    # GPU_DELTA_DEVICE=cpu is the script's dry-run switch (delta_bench.py --device cpu).
    results = tmp_path / "results"
    done = _dry_run("gpu_delta_check.sh", results, GPU_DELTA_DEVICE="cpu", GPU_DELTA_SIZES="0.05")
    rows = json.loads((results / "delta-0.05.json").read_text())
    assert len(rows) == 1, rows
    row = rows[0]
    assert row["kind"] == "delta" and row["device"] == "cpu"
    assert 0 < row["changed_fraction"] < 0.2 and 0 < row["bytes_ratio"] < 0.2, row
    for key in ("encode_s", "delta_write_s", "apply_s", "full_publish_s", "full_stage_s"):
        assert row[key] > 0, key
    for sample in row["samples"]:
        assert sample["delta_sync_s"] == sample["encode_s"] + sample["delta_write_s"] + sample["apply_s"]
    # Both paths wrote over a spare copy in the stage; both physical limits are there.
    assert row["spare_every_time"] and row["repeats"] == len(row["samples"]) == 1
    assert 0 < row["limit_delta_write_s"] < row["limit_full_write_s"] and 0 < row["limit_delta_s"] < row["limit_full_s"]
    assert "torch" in (results / "env.txt").read_text() and "done" in done.stdout


def test_rollout_bench_reports_live_and_replayed_overhead(tmp_path: Path) -> None:
    out = tmp_path / "rollout.json"
    done = _run(
        [
            sys.executable,
            str(BENCH / "rollout_bench.py"),
            "--skip-grpo",
            "--prompts",
            "2",
            "--n",
            "2",
            "--max-new-tokens",
            "8",
            "--repeats",
            "3",
            "--json",
            str(out),
        ],
        timeout=900,
    )
    o = json.loads(out.read_text())["overhead"]
    assert o["tokens_per_batch"] == 2 * 2 * 8
    assert len(o["pair_ratios"]) == 3 and len(o["seconds"]["direct"]) == len(o["seconds"]["trainer_hooks"]) == 3
    low, high = o["overhead_ci95"]
    assert low <= o["overhead"] <= high
    # The replay timed both clients on the recorded answer.
    assert o["response_bytes"] > 0 and all(t > 0 for t in o["replay_s"]["trainer_hooks"])
    assert o["client_overhead"] == o["client_extra_s"] / __import__("statistics").median(o["seconds"]["direct"])
    assert "client-side work on a replay" in done.stdout
