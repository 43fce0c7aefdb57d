"""A request that kills SGLang is retried once after the server comes back, then fails the step with
SGLang's own error; it is never resent in a loop.

The poison is real (a real SGLang, no fake): in SGLang 0.5.23, ``min_new_tokens > 0`` with a
``stop_token_ids`` entry outside the vocabulary makes the min-new-tokens penalizer scatter out of
bounds in the scheduler (``RuntimeError: index ... is out of bounds``), and the whole server exits.
It has nothing to do with ``torch.compile`` (unlike ``repetition_penalty`` on CPU), so a launcher
fix for that does not hide it.

The trainer refuses that stop token when it is built (it knows the model's vocabulary), so the
test puts the poison into the backend's sampling parameters after construction: it stands for a
request that kills SGLang which no check foresees.

One test uses the fake SGLang (`fake_sglang.FakeRollout` answering /generate with 500 while its
/health answers): a server behind a healthy front that the request kills. A real SGLang that a
request kills stops answering /health too, so a healthy front over a failing /generate cannot be
had from it without a router, which these tests do not run. (A proxy's or router's 502 and 504 are
not counted: tests/test_trainer_review_fixes.py.)
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fake_sglang import VOCAB_SIZE, FakeRollout
from rollout_unit import launch_unit, stop_unit, wait_ready
from trainer_helpers import make_config, make_trainer
from trainer_hooks.sglang_endpoints import SGLangPoisonRequestError, last_error_lines

POISON = {"min_new_tokens": 2, "stop_token_ids": [VOCAB_SIZE + 903]}
CRASH_MARK = "Scheduler hit an exception"


@pytest.mark.sglang
def test_a_request_that_kills_sglang_is_sent_twice_then_fails_the_step_naming_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    unit = launch_unit(tiny_model_dir, tmp_path / "unit")
    sglang_log = tmp_path / "unit" / "sglang.log"
    try:
        wait_ready(unit)
        config = make_config(
            tmp_path,
            unit.checkpoint_root,
            [unit.sglang_url],
            [unit.sidecar_url],
            sglang_log_paths=[str(sglang_log)],
            max_steps=2,
            sync_timeout=400.0,
        )
        trainer = make_trainer(tiny_model_dir, config)
        trainer.vllm_generation.sampling_params.update(POISON)  # past the trainer's own vocabulary check
        started = time.monotonic()
        with pytest.raises(SGLangPoisonRequestError) as caught:
            trainer.train()
        elapsed = time.monotonic() - started
        message = str(caught.value)
        # The request's sampling parameters, and SGLang's own last error line from its log.
        assert '"min_new_tokens": 2' in message and f'"stop_token_ids": [{VOCAB_SIZE + 903}]' in message, message
        assert f"RuntimeError: index {VOCAB_SIZE + 903} is out of bounds" in message, message
        assert "does not send it a third time" in message
        # The server died exactly twice (the first send and the one retry after it came back), and the
        # trainer failed at the second death, long before sync_timeout.
        time.sleep(3)
        assert sglang_log.read_text(errors="replace").count(CRASH_MARK) == 2
        assert elapsed < config.sync_timeout
        # The unit is still there (restarting SGLang), not at its restart limit.
        assert unit.process.poll() is None, "rollout-service serve exited"
        assert trainer.state.global_step == 0
        assert (tmp_path / "unit" / "stage").is_dir()
    finally:
        stop_unit(unit)
    assert not (tmp_path / "unit" / "stage").exists(), "serve left its stage directory behind"


def test_last_error_lines_are_the_end_of_the_last_traceback() -> None:
    log = "\n".join(
        [
            "[2026-12-01 11:06:04] Prefill batch, #new-seq: 2",
            "[2026-12-01 11:06:05] Scheduler hit an exception: Traceback (most recent call last):",
            '  File "scheduler.py", line 1, in run',
            "    old()",
            "ValueError: the first crash",
            "",
            "[2026-12-01 11:07:13] Scheduler hit an exception: Traceback (most recent call last):",
            '  File "scheduler.py", line 6368, in run_scheduler_process',
            "    scheduler.run_event_loop()",
            "           ^^^^^^^^^^^^^",
            "RuntimeError: index 4999 is out of bounds for dimension 1 with size 4097",
            "",
            "[2026-12-01 11:07:13] SIGQUIT received. signum=None, frame=None. It usually means one child failed.",
        ]
    )
    assert last_error_lines(log) == [
        "[2026-12-01 11:07:13] Scheduler hit an exception: Traceback (most recent call last):",
        "RuntimeError: index 4999 is out of bounds for dimension 1 with size 4097",
    ]
    assert last_error_lines("all fine\nINFO: 200 OK") == []


def test_a_request_failing_behind_a_healthy_front_is_sent_twice_not_until_the_deadline(
    tmp_path: Path, fake: FakeRollout
) -> None:
    # A healthy front (a router) over a server the request kills: 500 on /generate, its own /health answers.
    from trainer_hooks.sglang_endpoints import SGLangEndpoints

    fake.generate_status = 500
    log = tmp_path / "sglang.log"
    log.write_text(
        "[t] Scheduler hit an exception: Traceback (most recent call last):\n"
        '  File "x.py", line 1, in f\nValueError: the poison\n\n[t] SIGQUIT received.\n'
    )
    endpoints = SGLangEndpoints([fake.url], request_timeout_s=10, log_paths=[str(log)])
    import trainer_hooks.sglang_endpoints as module

    saved, module.DEAD_RETRY_S = module.DEAD_RETRY_S, 0.2
    try:
        started = time.monotonic()
        with pytest.raises(SGLangPoisonRequestError) as caught:
            endpoints.generate(
                [[5, 6, 7]],
                {"n": 2, "max_new_tokens": 4, "top_k": 3},
                want_logprobs=True,
                deadline=time.monotonic() + 60,
            )
        assert time.monotonic() - started < 30
    finally:
        module.DEAD_RETRY_S = saved
        endpoints.close()
    assert len(fake.generate_requests) == 2
    message = str(caught.value)
    assert "failed (5xx or a broken connection) on the same request" in message and '"top_k": 3' in message
    assert "HTTP 500" in message and "ValueError: the poison" in message and str(log) in message
