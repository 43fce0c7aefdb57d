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
    assert heartbeat_problem(now - 120, now=now, max_age_s=60) == "last heartbeat 120 s ago by this host's clock"
    assert len(AckFileWaiter(tmp_path, 3, max_age_s=60).wait(3, timeout_s=5)) == 3


@pytest.mark.parametrize("text", ["1" + "0" * 400, "NaN", "1e400", "-1e400"])
def test_a_report_reads_a_heartbeat_that_is_no_finite_time_as_absent(text: str) -> None:
    assert ReplicaReport.from_dict(json.loads(f'{{"heartbeat": {text}}}')).heartbeat is None
    assert ReplicaReport.from_dict({"heartbeat": 12}).heartbeat == 12.0


def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def _from_deep_in_the_stack(call, frames_left: int = 60):
    """Run ``call`` with only ``frames_left`` frames of recursion left, as deep inside a trainer."""
    import sys

    def down(n: int):
        return call() if n <= 0 else down(n - 1)

    import inspect

    return down(sys.getrecursionlimit() - len(inspect.stack()) - frames_left)


def test_a_forged_ack_nested_deep_is_named_not_a_recursion_error_from_deep_inside_a_trainer(tmp_path: Path) -> None:
    """A list nested ~900 deep parses (on the listing's fresh, shallow thread) and was quoted on the
    trainer's deep stack: RecursionError ended training. What a reader keeps of an ack is flat."""
    (tmp_path / "acks").mkdir()
    deep = _nested(900)
    (tmp_path / "acks" / "forged.json").write_text(
        f'{{"heartbeat": {deep}, "loaded_step": 1, "last_error": {{"reason": {deep}, "message": {deep}}},'
        f' "rejected": {{"5": {deep}}}, "extra": {deep}}}'
    )
    waiter = AckFileWaiter(tmp_path, 1, max_age_s=60)
    with pytest.raises(ReplicaSyncTimeout, match=r"forged \(heartbeat is str 'a list of 1 values', not a finite time"):
        _from_deep_in_the_stack(lambda: waiter.wait(3, timeout_s=0.2))
    assert _from_deep_in_the_stack(waiter.protected_versions) == set()
    ack = read_acks(tmp_path)["forged"]
    assert set(ack) == {"heartbeat", "loaded_step", "last_error", "rejected"}  # "extra" is not a field
    assert ack["last_error"] == {"reason": "a list of 1 values", "message": "a list of 1 values"}
    assert ReplicaReport.from_dict(ack).rejected == {"5": "a list of 1 values"}


def test_a_flood_of_forged_acks_is_held_as_the_fields_a_reader_uses(tmp_path: Path) -> None:
    """64 KiB of ``{}`` parses to ~1.5 MB of objects: 10,000 such acks were ~15 GB held at once."""
    import tracemalloc

    (tmp_path / "acks").mkdir()
    body = '{"loaded_step": 1, "rejected": {' + ", ".join(f'"{i}": {{}}' for i in range(5000)) + "}}"
    assert len(body) < 64 << 10
    for i in range(50):
        (tmp_path / "acks" / f"r{i}.json").write_text(body)
    tracemalloc.start()
    acks = read_acks(tmp_path)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(acks) == 50 and all(len(a["rejected"]) == 100 for a in acks.values())
    assert held < 50 * 64 << 10, held  # less than the files' own bytes, not 50 x 1.5 MB
    assert ReplicaReport.from_dict(acks["r0"]).rejected["0"] == "a JSON object of 0 keys"
