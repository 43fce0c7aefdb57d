"""The root gate's bounds, with calls that block on an event instead of a hung file system
(tests/test_hung_root.py freezes a real one): a blocked call costs its caller the bound, the
calls after it fail at once, threads stay bounded, and the first call that comes back ends it."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from rollout_service.sidecar.root_gate import MAX_THREADS, RootGate, RootUnresponsive, answered_within

BOUND_S = 2.0
"""The gate's bound in the test that times one out: long enough that half of it is far above what
a call that does not wait takes on a loaded machine."""
SLACK_S = 1.5
"""How far past its bound a timed-out call may end (a loaded machine)."""


def test_a_blocked_call_times_out_then_later_calls_fail_at_once_until_it_returns():
    changes: list[str | None] = []
    release = threading.Event()

    async def scenario() -> None:
        gate = RootGate(Path("/ckpt"), timeout_s=BOUND_S, on_change=changes.append)
        assert await gate.call(lambda: 7, what="a quick look") == 7
        t0 = time.monotonic()
        with pytest.raises(RootUnresponsive, match=f"listing did not come back within {BOUND_S:g} s"):
            await gate.call(release.wait, what="listing")
        # The blocked call costs its caller the bound: no less, and not much more (the gate's
        # promise; the margin is for a loaded machine).
        assert BOUND_S - 0.05 < time.monotonic() - t0 < BOUND_S + SLACK_S
        assert gate.problem is not None and "/ckpt" in gate.problem
        t0 = time.monotonic()
        ran = []
        with pytest.raises(RootUnresponsive, match="listing has been blocked"):
            await gate.call(ran.append, 1, what="another look")
        assert not ran, "no second thread starts behind a blocked one"
        # ... and it fails without waiting for the bound itself, as the blocked call did.
        assert time.monotonic() - t0 < BOUND_S / 2
        release.set()
        await asyncio.sleep(0.1)  # the blocked thread comes back
        assert await gate.call(lambda: "ok", what="a look after") == "ok"
        assert gate.problem is None

    asyncio.run(scenario())
    assert changes[-1] is None and len(changes) >= 2 and all(c is not None for c in changes[:-1])


def test_the_calls_own_errors_pass_through_and_count_as_answers():
    async def scenario() -> None:
        gate = RootGate(Path("/ckpt"), timeout_s=0.2)
        gate.problem = "left over"

        def fails() -> None:
            raise FileNotFoundError("step-00000001")

        with pytest.raises(FileNotFoundError):
            await gate.call(fails, what="a stat")
        assert gate.problem is None, "an error is an answer: the storage responds"

    asyncio.run(scenario())


def test_at_most_max_threads_run_at_once():
    release = threading.Event()
    running = []
    lock = threading.Lock()
    peak = [0]

    def slow() -> None:
        with lock:
            running.append(1)
            peak[0] = max(peak[0], len(running))
        release.wait(5)
        with lock:
            running.pop()

    async def scenario() -> list[object]:
        gate = RootGate(Path("/ckpt"), timeout_s=1.0)
        calls = [asyncio.ensure_future(gate.call(slow, what=f"look {i}")) for i in range(3 * MAX_THREADS)]
        await asyncio.sleep(0.3)
        assert peak[0] == MAX_THREADS
        release.set()
        return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = asyncio.run(scenario())
    assert peak[0] == MAX_THREADS
    assert all(o is None for o in outcomes), outcomes  # the queued ones ran once slots freed


def test_a_call_blocked_for_good_does_not_hold_up_the_exit(tmp_path):
    import subprocess
    import sys

    code = (
        "import asyncio, threading\n"
        "from pathlib import Path\n"
        "from rollout_service.sidecar.root_gate import RootGate, RootUnresponsive\n"
        "async def main():\n"
        "    gate = RootGate(Path('/x'), timeout_s=0.2)\n"
        "    try:\n"
        "        await gate.call(threading.Event().wait, what='forever')\n"
        "    except RootUnresponsive:\n"
        "        print('gave up')\n"
        "asyncio.run(main())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and "gave up" in done.stdout, done.stderr


def test_start_up_checks_give_up_after_their_bound_and_pass_answers_and_errors_through():
    t0 = time.monotonic()
    assert answered_within(threading.Event().wait, 0.2, "blocked") == (False, None)
    assert time.monotonic() - t0 < 2.0
    assert answered_within(lambda: 42, 5.0, "quick") == (True, 42)

    def fails() -> None:
        raise NotADirectoryError("/ckpt")

    with pytest.raises(NotADirectoryError):
        answered_within(fails, 5.0, "fails")


def test_a_look_that_comes_back_after_its_caller_gave_up_ends_the_condition():
    changes: list[str | None] = []
    release = threading.Event()

    async def scenario() -> None:
        gate = RootGate(Path("/ckpt"), timeout_s=0.2, on_change=changes.append)
        with pytest.raises(RootUnresponsive):
            await gate.call(release.wait, what="a slow listing")
        assert gate.problem is not None
        release.set()
        for _ in range(50):  # no other call needed: the late answer itself counts
            if gate.problem is None:
                break
            await asyncio.sleep(0.02)
        assert gate.problem is None and changes[-1] is None

    asyncio.run(scenario())


def test_an_answer_does_not_end_the_condition_while_another_look_is_still_blocked():
    hung = threading.Event()

    async def scenario() -> None:
        gate = RootGate(Path("/ckpt"), timeout_s=0.3)
        listing = asyncio.ensure_future(gate.call(hung.wait, what="a hung listing"))
        await asyncio.sleep(0.1)
        # A look started later, answering within its own bound (from a cache, say) but after the
        # listing passed its bound: the listing is still blocked, so the condition stands.
        await gate.call(time.sleep, 0.25, what="a cached stat")
        with pytest.raises(RootUnresponsive):
            await listing
        assert gate.problem is not None and gate.blocked() is not None
        hung.set()
        await asyncio.sleep(0.1)
        assert gate.problem is None

    try:
        asyncio.run(scenario())
    finally:
        hung.set()


def test_waiting_for_a_slot_does_not_count_as_the_root_being_slow():
    async def scenario() -> None:
        gate = RootGate(Path("/ckpt"), timeout_s=1.0)
        # Twice as many looks as threads, each within the bound once it runs: all answer, none
        # marks the root (the second half waits 0.6 s for a thread, then runs 0.6 s).
        calls = [gate.call(time.sleep, 0.6, what=f"look {i}") for i in range(2 * MAX_THREADS)]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert gate.problem is None and gate.blocked() is None
        assert outcomes == [None] * (2 * MAX_THREADS)

    asyncio.run(scenario())


def test_a_look_whose_caller_was_cancelled_still_ends_the_condition_when_it_comes_back():
    release = threading.Event()

    async def scenario() -> None:
        gate = RootGate(Path("/ckpt"), timeout_s=0.2)
        # A /wait gives up on its look (its own deadline) before the gate's bound ...
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(gate.call(release.wait, what="/wait's look"), 0.1)
        await asyncio.sleep(0.2)
        with pytest.raises(RootUnresponsive, match="has not come back"):  # ... which it then outlives
            await gate.call(lambda: None, what="the loop's listing")
        assert gate.problem is not None
        release.set()
        for _ in range(50):
            if gate.problem is None:
                break
            await asyncio.sleep(0.02)
        assert gate.problem is None

    asyncio.run(scenario())


def test_a_thread_that_cannot_start_leaves_nothing_in_flight(monkeypatch):
    from rollout_service.sidecar import root_gate

    async def scenario() -> None:
        gate = RootGate(Path("/ckpt"), timeout_s=0.2)

        def no_thread(*args, **kwargs):
            raise RuntimeError("can't start new thread")

        with monkeypatch.context() as m:
            m.setattr(root_gate, "in_daemon_thread", no_thread)
            for _ in range(MAX_THREADS + 1):
                with pytest.raises(RuntimeError):
                    await gate.call(lambda: None, what="a look")
        await asyncio.sleep(0.3)
        assert gate.blocked() is None
        assert await gate.call(lambda: 5, what="a look with threads again") == 5

    asyncio.run(scenario())
