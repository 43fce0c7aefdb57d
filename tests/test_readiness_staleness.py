"""``GET /readyz?staleness=K``: a replica serving a step at most K older than the newest stays ready.

A Kubernetes Service routes only to ready pods, and ``/readyz`` is 503 from the moment a replica
sees a newer step until it serves it: every replica sees it at about the same time, so during each
sync the Service had no endpoints and a trainer with ``max_staleness=K`` (which takes rollouts from
weights up to K versions old while the next version loads) had nowhere to send them. With
``?staleness=K`` in the readiness probe's path the replicas stay in the Service through a sync, as
long as what they serve is within K of the newest; plain ``/readyz`` is unchanged.

The window in the middle of a sync is held open with the in-process fake SGLang client of
tests/test_sync_loop_hazards.py (a real tiny model loads too fast to look at it); the HTTP
parameter is checked on the real app.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.sidecar.app import create_app
from test_sglang_lost_during_pass import serving_step_1, step_2_staging
from test_sidecar_api_review_fixes import settings
from test_sync_loop_hazards import CONFIG, RUN, run_with, tensors, until


def test_a_replica_loading_the_next_step_is_ready_within_the_staleness_asked(tmp_path: Path) -> None:
    root, c, sglang = serving_step_1(tmp_path)
    seen: dict[str, tuple[bool, str]] = {}

    async def during() -> None:
        await until(lambda: c.readiness()[0])
        await step_2_staging(root, c)  # step 2 published, being staged: step 1 served
        await c._publish_state()  # a listing saw step 2 (the loop lists between passes)
        assert c.state.newest_known_step == 2 and c.state.loading_step == 2
        for k in (0, 1, 2):
            seen[f"stale {k}"] = c.readiness(k)
        publish_checkpoint(root, 3, tensors(3), config=CONFIG, run_id=RUN)
        await c._publish_state()
        assert c.state.newest_known_step == 3 and c.state.loading_step == 2
        seen["two behind, 1"] = c.readiness(1)
        seen["two behind, 2"] = c.readiness(2)
        sglang.unanswered_views = 10**9  # SGLang stops answering: stale weights are no weights
        await until(lambda: not c.state.sglang_healthy)
        seen["silent"] = c.readiness(5)
        sglang.unanswered_views = 0
        await until(lambda: c.serves(3), 30)
        seen["newest"] = c.readiness(0)

    run_with(c, during)
    assert seen["stale 0"][0] is False and "not serving the newest" in seen["stale 0"][1]
    for k in (1, 2):
        ready, why = seen[f"stale {k}"]
        assert ready and f"serving step 1, 1 older than the newest (2): within staleness {k}" == why
    assert seen["two behind, 1"][0] is False and seen["two behind, 2"][0] is True
    assert seen["silent"][0] is False
    assert seen["newest"] == (True, "serving the newest valid checkpoint")


@pytest.mark.parametrize(
    "query",
    [
        "staleness=-1",
        "staleness=1.5",
        "staleness=x",
        "staleness=100000000",
        # Spellings pydantic's int reads (a probe's typo widened the window instead of a 400):
        "staleness=1_0",
        "staleness=%2B10",
        "staleness=%2010",
        "staleness=10.0",
        "staleness=",
    ],
)
def test_a_staleness_that_is_no_step_count_is_refused_naming_it(tmp_path: Path, query: str) -> None:
    with TestClient(create_app(settings(tmp_path)), base_url="http://127.0.0.1") as client:
        answer = client.get(f"/readyz?{query}")
        assert answer.status_code == 400 and "staleness" in answer.text
        assert client.get("/readyz?staleness=3").status_code == 503  # (nothing served here)


def test_staleness_counts_published_steps_not_step_numbers(tmp_path: Path) -> None:
    """A trainer counts ``max_staleness`` in publishes, and its numbering skips names a stray
    entry holds: serving step 1 with step 3 the next published one is one behind, not two."""
    root, c, sglang = serving_step_1(tmp_path)
    seen: dict[str, tuple[bool, str]] = {}

    async def during() -> None:
        await until(lambda: c.readiness()[0])
        (root / "step-00000002").write_text("a stray file, not a checkpoint")
        hold = asyncio.Event()

        async def slow_load(path: str, version: str) -> None:
            await hold.wait()

        sglang.load_hook = slow_load
        publish_checkpoint(root, 3, tensors(3), config=CONFIG, run_id=RUN)
        await until(lambda: c.state.sglang_loading_step == 3, 30)
        await c._publish_state()
        seen["one publish behind"] = c.readiness(1)
        hold.set()
        await until(lambda: c.serves(3), 30)

    run_with(c, during)
    ready, why = seen["one publish behind"]
    assert ready and "serving step 1, 1 older than the newest (3): within staleness 1" == why, why


def test_steps_retention_deleted_between_still_count(tmp_path: Path) -> None:
    """A trainer's retention deletes publishes no replica needs: serving 5 with 9 the newest and 6
    deleted is four publishes behind (the count of listed folders said three: ready within 3)."""
    root, c, sglang = serving_step_1(tmp_path)
    seen: dict[str, tuple[bool, str]] = {}

    async def during() -> None:
        await until(lambda: c.readiness()[0])
        hold = asyncio.Event()

        async def slow_load(path: str, version: str) -> None:
            await hold.wait()

        sglang.load_hook = slow_load
        for step in (2, 3, 4, 5):  # 2 and 4 deleted by retention, 3 a stray file: 5 is 3 publishes on
            publish_checkpoint(root, step, tensors(step), config=CONFIG, run_id=RUN)
        shutil.rmtree(root / "step-00000002")
        shutil.rmtree(root / "step-00000003")
        (root / "step-00000003").write_text("a stray file, not a checkpoint")
        shutil.rmtree(root / "step-00000004")
        await until(lambda: c.state.sglang_loading_step == 5, 30)
        await c._publish_state()
        seen["2"] = c.readiness(2)
        seen["3"] = c.readiness(3)
        hold.set()
        await until(lambda: c.serves(5), 30)

    run_with(c, during)
    assert seen["2"][0] is False, seen["2"]
    ready, why = seen["3"]
    assert ready and "serving step 1, 3 older than the newest (5): within staleness 3" == why, why
