"""Several SGLang endpoints: prompts split in order, dead endpoints skipped, all dead named.

These run against the fake SGLang (`fake_sglang.FakeRollout`) and URLs nothing listens on. A dead
endpoint needs no server; the split's order is read from the fake's completions, which start with
their prompt's first token (a real SGLang's say nothing of which prompt they answer). The same
split through two real SGLang servers, one dead URL between them, is
test_serve_and_replicas.py::test_grpo_spreads_rollouts_over_two_real_servers_and_skips_a_dead_one
(each live server answered some prompts, the dead one none); what the fake test adds is the exact
split and that each group comes back in its prompt's place.
"""

from __future__ import annotations

import logging
import time

import pytest

from fake_sglang import VOCAB_SIZE, FakeRollout, dead_url
from trainer_hooks.sglang_endpoints import SGLangEndpoints, SGLangUnavailableError


def test_batch_is_split_across_endpoints_in_prompt_order(fake: FakeRollout) -> None:
    other = FakeRollout().start()
    try:
        endpoints = SGLangEndpoints([fake.url, other.url], request_timeout_s=10, vocab_size=VOCAB_SIZE)
        groups = endpoints.generate(
            [[11, 1], [22, 2], [33, 3]],
            {"n": 2, "max_new_tokens": 3},
            want_logprobs=True,
            deadline=time.monotonic() + 10,
        )
        endpoints.close()
    finally:
        other.stop()
    assert [[c.token_ids[0] for c in group] for group in groups] == [[11, 11], [22, 22], [33, 33]]
    assert [len(r["input_ids"]) for r in fake.generate_requests] == [2]
    assert [len(r["input_ids"]) for r in other.generate_requests] == [1]


def test_dead_endpoint_is_skipped_while_another_answers(fake: FakeRollout, caplog: pytest.LogCaptureFixture) -> None:
    dead = dead_url()
    endpoints = SGLangEndpoints([dead, fake.url], request_timeout_s=10)
    with caplog.at_level(logging.WARNING):
        groups = endpoints.generate(
            [[1, 2], [3, 4]], {"n": 1, "max_new_tokens": 2}, want_logprobs=False, deadline=time.monotonic() + 10
        )
    endpoints.close()
    assert [g[0].token_ids[0] for g in groups] == [1, 3]
    assert any(
        dead in r.getMessage() and "other endpoint(s) take its prompts" in r.getMessage() for r in caplog.records
    )


def test_all_endpoints_dead_raises_naming_each_after_the_deadline() -> None:
    dead_a, dead_b = dead_url(), dead_url()
    endpoints = SGLangEndpoints([dead_a, dead_b], request_timeout_s=5)
    started = time.monotonic()
    with pytest.raises(SGLangUnavailableError) as info:
        endpoints.generate([[1, 2]], {"n": 1, "max_new_tokens": 2}, want_logprobs=False, deadline=time.monotonic() + 2)
    endpoints.close()
    assert dead_a in str(info.value) and dead_b in str(info.value)
    assert 2 <= time.monotonic() - started < 15
