"""Ack files under <root>/acks are untrusted: a heartbeat that is no sane time (not a number, NaN,
Inf, an integer too large for a float, far in the future) marks the ack dead with a reason, and
never crashes the trainer's wait."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from rollout_service.protocol import MAX_CLOCK_SKEW_S, ReplicaReport, heartbeat_problem, read_acks
from trainer_hooks.replica_wait import AckFileWaiter, ReplicaSyncTimeout

INSANE_HEARTBEATS = {
    "a 400-digit integer": ("1" + "0" * 400, "an integer of"),
    "NaN": ("NaN", "float 'nan'"),
    "Infinity": ("1e400", "float 'inf'"),
    "a string": ('"yesterday"', "str 'yesterday'"),
    "a boolean": ("true", "bool 'True'"),
    "missing": (None, "missing"),
    "far in the future": (None, "in the future"),
}
"""name -> (the heartbeat as JSON text; None: see ack_text), what the reason says."""


def ack_text(name: str) -> str:
    heartbeat, _ = INSANE_HEARTBEATS[name]
    if name == "missing":
        return json.dumps({"loaded_step": 9})
    if name == "far in the future":
        heartbeat = repr(time.time() + 10 * MAX_CLOCK_SKEW_S)
    return f'{{"loaded_step": 9, "heartbeat": {heartbeat}}}'


def write_stray(root: Path, name: str) -> None:
    (root / "acks").mkdir(exist_ok=True)
    (root / "acks" / "stray.json").write_text(ack_text(name))


@pytest.mark.parametrize("name", sorted(INSANE_HEARTBEATS))
def test_an_ack_with_an_insane_heartbeat_is_not_live(tmp_path: Path, name: str) -> None:
    write_stray(tmp_path, name)
    assert read_acks(tmp_path, max_age_s=3600) == {}
    assert list(read_acks(tmp_path)) == ["stray"]  # still listed when freshness does not matter
    ack = read_acks(tmp_path)["stray"]
    problem = heartbeat_problem(ack.get("heartbeat"), now=time.time(), max_age_s=3600)
    assert problem is not None and INSANE_HEARTBEATS[name][1] in problem


@pytest.mark.parametrize("name", sorted(INSANE_HEARTBEATS))
def test_the_ack_waiter_times_out_naming_the_insane_ack(tmp_path: Path, name: str) -> None:
    write_stray(tmp_path, name)
    with pytest.raises(ReplicaSyncTimeout, match=r"without a fresh heartbeat \(dead\?\): stray \(.*") as exc:
        AckFileWaiter(tmp_path, 1, max_age_s=60).wait(3, timeout_s=0.2)
    assert INSANE_HEARTBEATS[name][1] in str(exc.value)


def test_fresh_heartbeats_within_the_clock_skew_allowance_are_live(tmp_path: Path) -> None:
    (tmp_path / "acks").mkdir()
    now = time.time()
    for name, beat in {"now": now, "ahead": now + MAX_CLOCK_SKEW_S / 2, "int": int(now)}.items():
        (tmp_path / "acks" / f"{name}.json").write_text(json.dumps({"loaded_step": 3, "heartbeat": beat}))
    (tmp_path / "acks" / "old.json").write_text(json.dumps({"loaded_step": 3, "heartbeat": now - 120}))
    assert sorted(read_acks(tmp_path, max_age_s=60)) == ["ahead", "int", "now"]
    assert heartbeat_problem(now - 120, now=now, max_age_s=60) == "last heartbeat 120 s ago"
    assert len(AckFileWaiter(tmp_path, 3, max_age_s=60).wait(3, timeout_s=5)) == 3


@pytest.mark.parametrize("text", ["1" + "0" * 400, "NaN", "1e400", "-1e400"])
def test_a_report_reads_a_heartbeat_that_is_no_finite_time_as_absent(text: str) -> None:
    assert ReplicaReport.from_dict(json.loads(f'{{"heartbeat": {text}}}')).heartbeat is None
    assert ReplicaReport.from_dict({"heartbeat": 12}).heartbeat == 12.0
