"""The replica protocol: version <-> step, the report's round trip and its tolerance of junk."""

from __future__ import annotations

import json
import os

from rollout_service.protocol import ReplicaReport, atomic_replace, step_for_version, version_for_step


def test_versions_and_steps_convert_both_ways_and_nothing_else_is_a_step():
    for step in (0, 1, 42, 99_999_999):
        assert step_for_version(version_for_step(step)) == step
    for junk in ("default", "", "\u0661\u0662", "12a", "-1", "1.0", "123456789", True, None, 10**9, -3, 1.0):
        assert step_for_version(junk) is None, junk


def test_report_round_trips_and_reads_wrong_types_as_absent():
    report = ReplicaReport(
        "r1",
        loaded_step=7,
        weight_version="7",
        run_id="abc",
        fingerprint="f" * 32,
        loaded_current=False,
        loading_step=8,
        ready=True,
        sglang_healthy=True,
        sglang_url="http://x",
        last_error={"reason": "truncated"},
        rejected={"9": "truncated"},
        heartbeat=1.5,
    )
    assert ReplicaReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    junk = ReplicaReport.from_dict(
        {"loaded_step": "7", "loading_step": True, "ready": "yes", "run_id": 5, "rejected": [1], "heartbeat": "now"},
        replica_id="r2",
    )
    assert junk == ReplicaReport("r2")
    assert ReplicaReport.from_dict([1, 2], replica_id="r3") == ReplicaReport("r3")


def test_atomic_replace_leaves_old_or_new_and_no_temp_file(tmp_path):
    (tmp_path / "a.json").write_text("old")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        atomic_replace(fd, "a.json", b"new", owner="me")
    finally:
        os.close(fd)
    assert (tmp_path / "a.json").read_text() == "new"
    assert os.listdir(tmp_path) == ["a.json"]
