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
