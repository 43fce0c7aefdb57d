"""Answers SGLang cannot have meant are refused by name, in /generate and in the rescoring request
alike: impossible logprobs, answers for another prompt or longer than asked, token ids beyond any
vocabulary, an error object in a 200, and malformed rescoring answers.

The HTTP cases drive the real `SGLangEndpoints` against `fake_sglang.CannedServer` (scripted
answers): a real SGLang server cannot be made to send a +inf logprob, another prompt's answer or a
malformed rescoring result on demand.
"""

from __future__ import annotations

import copy
import re
import time
from typing import Any

import pytest

import trainer_hooks.sglang_endpoints as sglang_endpoints
from fake_sglang import CannedServer, canned_answer, canned_reply
from trainer_hooks.sglang_endpoints import SGLangEndpoints, SGLangRequestError, SGLangUnavailableError
from trainer_hooks.sglang_responses import Completion, SGLangResponseError, parse_generate_response

ITEM = {
    "output_ids": [5, 7],
    "meta_info": {"weight_version": "3", "output_token_logprobs": [[-1.0, 5, None], [-2.0, 7, None]]},
}


def parse(item: dict[str, Any], vocab_size: int | None = 100) -> Completion:
    [[completion]] = parse_generate_response([item], num_prompts=1, n=1, want_logprobs=True, vocab_size=vocab_size)
    return completion


def with_logprob(value: Any, index: int = 0) -> dict[str, Any]:
    item = copy.deepcopy(ITEM)
    item["meta_info"]["output_token_logprobs"][index][0] = value
    return item


@pytest.mark.parametrize("value", [float("inf"), 3.0, 0.01, 1], ids=["+inf", "3.0", "0.01", "int-1"])
def test_logprobs_above_zero_are_refused(value: Any) -> None:
    with pytest.raises(SGLangResponseError, match=r"output_token_logprobs\[0\]: logprob .* is impossible"):
        parse(with_logprob(value))


@pytest.mark.parametrize("value", [10**400, -(10**400)], ids=["huge", "huge-negative"])
def test_an_integer_logprob_past_floats_range_is_a_response_error(value: int) -> None:
    """Before, a bare OverflowError naming no server, result or field."""
    with pytest.raises(SGLangResponseError, match=r"output_token_logprobs\[0\]: logprob is an integer of 1329 bits"):
        parse(with_logprob(value))
    mixed = with_logprob(-1, index=1)  # the entry-by-entry path
    mixed["meta_info"]["output_token_logprobs"][0][0] = value
    with pytest.raises(SGLangResponseError, match="past any float"):
        parse(mixed)


def test_minus_infinity_and_nan_mean_no_correction_and_rounding_above_zero_passes() -> None:
    assert parse(with_logprob(float("-inf"))).logprobs == [None, -2.0]  # the one-pass path
    assert parse(with_logprob(float("nan"))).logprobs == [None, -2.0]
    assert parse(with_logprob(5e-5)).logprobs == [5e-5, -2.0]
    mixed = with_logprob(-3, index=1)  # an int: the entry-by-entry path, same rules
    mixed["meta_info"]["output_token_logprobs"][0][0] = float("-inf")
    assert parse(mixed).logprobs == [None, -3.0]
    with pytest.raises(SGLangResponseError, match="expected a number as logprob, found '-0.2'"):
        parse(with_logprob("-0.2"))


def test_token_ids_are_bounded_when_the_vocabulary_size_is_unknown() -> None:
    for bad, message in [
        (10**30, r"token id 10+ is outside \[0, 2\*\*31\)"),
        (2**31, r"outside \[0, 2\*\*31\)"),
        (1e300, "too large to be an exact token id"),
        (2.0**53 + 2, "too large to be an exact token id"),
    ]:
        item = copy.deepcopy(ITEM)
        item["output_ids"][0] = bad
        item["meta_info"]["output_token_logprobs"][0][1] = bad
        with pytest.raises(SGLangResponseError, match=message):
            parse(item, vocab_size=None)
    item = copy.deepcopy(ITEM)
    item["output_ids"][0] = item["meta_info"]["output_token_logprobs"][0][1] = 2**31 - 1
    assert parse(item, vocab_size=None).token_ids == [2**31 - 1, 7]


def ask(
    servers: list[CannedServer], answer: Any, *, rescore: bool = False, deadline_s: float = 5
) -> tuple[list[list[Completion]] | BaseException, CannedServer]:
    """``generate`` of one 3-token prompt (n=1, max_new_tokens=4) against ``answer(body)`` for the
    first /generate and a good answer for the rest (``rescore``: the other way round)."""

    def handler(path: str, body: Any, count: int) -> Any:
        if path != "/generate":
            return None
        rescoring = body["sampling_params"].get("max_new_tokens") == 0
        if rescoring != rescore:
            return canned_reply(200, canned_answer(body))
        reply = answer(body)
        return reply if callable(reply) else canned_reply(200, reply)

    server = CannedServer(handler)
    servers.append(server)
    endpoints = SGLangEndpoints([server.url], request_timeout_s=10, vocab_size=100)
    try:
        return (
            endpoints.generate(
                [[1, 2, 3]],
                {"n": 1, "max_new_tokens": 4},
                want_logprobs=True,
                deadline=time.monotonic() + deadline_s,
                rescore=rescore,
            ),
            server,
        )
    except Exception as exc:
        return exc, server
    finally:
        endpoints.close()


def test_an_answer_for_another_prompt_is_refused(servers: list[CannedServer]) -> None:
    def other_prompt(body: Any) -> Any:
        answer = canned_answer(body)
        answer[0]["meta_info"]["prompt_tokens"] = 9
        return answer

    result, _ = ask(servers, other_prompt)
    assert isinstance(result, SGLangResponseError), result
    assert "meta_info.prompt_tokens is 9 but the prompt sent has 3 tokens" in str(result)
    result, _ = ask(servers, lambda body: canned_answer(body, prompt_tokens=False))  # not reported: fine
    assert isinstance(result, list), result


def test_more_output_ids_than_max_new_tokens_are_refused(servers: list[CannedServer]) -> None:
    def too_long(body: Any) -> Any:
        ids = list(range(50))
        return [{"output_ids": ids, "meta_info": {"output_token_logprobs": [[-0.5, t, None] for t in ids]}}]

    result, _ = ask(servers, too_long)
    assert isinstance(result, SGLangResponseError), result
    assert "50 output ids for max_new_tokens=4" in str(result)


def test_an_error_object_in_a_200_is_quoted(servers: list[CannedServer]) -> None:
    result, _ = ask(servers, lambda body: {"object": "error", "message": "the scheduler is gone", "code": 500})
    assert isinstance(result, SGLangResponseError), result
    assert "answered HTTP 200 with an error instead of results: the scheduler is gone" in str(result)


def rescored(logprobs: list[Any], tokens: tuple[Any, ...] = (1, 7), version: Any = "5") -> list[dict[str, Any]]:
    """A rescoring answer for prompt [1, 2, 3] + completion [1, 7] (entry 0: the last prompt token)."""
    entries = [[None, 3, None]] + [[lp, t, None] for lp, t in zip(logprobs, tokens)]
    return [{"meta_info": {"input_token_logprobs": entries, "weight_version": version}}]


def test_rescored_logprobs_replace_the_sampled_ones_by_the_same_rules(servers: list[CannedServer]) -> None:
    result, _ = ask(servers, lambda body: rescored([-0.2, float("-inf")], tokens=(1.0, 7.0)), rescore=True)
    assert isinstance(result, list), result
    assert result[0][0].logprobs == [-0.2, None]
    result, _ = ask(servers, lambda body: rescored([-0.2, -0.3], version="4"), rescore=True)
    assert isinstance(result, list) and result[0][0].logprobs == [None, None]  # other weights: no correction
    result, _ = ask(servers, lambda body: rescored([-0.2, -0.3], version=5), rescore=True)
    assert isinstance(result, list) and result[0][0].logprobs == [-0.2, -0.3]  # 5 and "5": one parser


@pytest.mark.parametrize(
    "answer, message",
    [
        ([{"meta_info": None}], r"result 0: expected a JSON object with a meta_info object"),
        ([{"meta_info": {"weight_version": "5"}}], r"input_token_logprobs is None, expected a list"),
        ([7], r"result 0: expected a JSON object with a meta_info object"),
        (
            [{"meta_info": {"input_token_logprobs": [None, 5, 6], "weight_version": "5"}}],
            r"input_token_logprobs\[0\] is None, expected \[logprob, token_id, ...\]",
        ),
        (
            [{"meta_info": {"input_token_logprobs": [[None], [-0.1], [-0.2]], "weight_version": "5"}}],
            r"input_token_logprobs\[0\] is \[None\]",
        ),
        (rescored([float("inf"), -0.1]), r"input_token_logprobs\[1\]: logprob inf is impossible"),
        (rescored([-0.1, 4.0]), r"input_token_logprobs\[2\]: logprob 4.0 is impossible"),
        (rescored(["-0.2", -0.1]), r"input_token_logprobs\[1\]: expected a number as logprob, found '-0.2'"),
        (rescored([-0.2, "nan"]), r"input_token_logprobs\[2\]: expected a number as logprob, found 'nan'"),
        (rescored([-0.2, -0.1], tokens=(1, "7")), r"input_token_logprobs\[2\]: expected an integer token id"),
        (rescored([-0.2, -0.1]) * 2, r"answered 2 results for 1 sequences to rescore"),
        ({"error": {"message": "no such adapter"}}, r"with an error instead of results: no such adapter"),
    ],
    ids=[
        "meta-null",
        "no-entries",
        "not-an-object",
        "entries-not-lists",
        "short-entries",
        "+inf",
        "positive",
        "string",
        "string-nan",
        "string-token",
        "too-many",
        "error-object",
    ],
)
def test_a_malformed_rescoring_answer_is_named_like_a_generate_answer(
    servers: list[CannedServer], answer: Any, message: str
) -> None:
    result, _ = ask(servers, lambda body: answer, rescore=True)
    assert isinstance(result, SGLangResponseError), repr(result)
    assert "(rescoring)" in str(result)
    assert re.search(message, str(result)), str(result)


@pytest.mark.parametrize("body", ["<html><body>502 Bad Gateway</body></html>", ""], ids=["html", "empty"])
def test_a_rescoring_answer_that_is_not_json_fails_the_endpoint_over(servers: list[CannedServer], body: str) -> None:
    result, server = ask(
        servers, lambda _: canned_reply(200, body, content_type="text/html"), rescore=True, deadline_s=1
    )
    assert isinstance(result, SGLangUnavailableError), repr(result)
    assert "rescoring: answered HTTP 200 with a body that is not JSON" in str(result)
    assert len(server.generate_requests) >= 2


ADAPTER_SWAPPED = {"object": "error", "message": "LoRA adapter v00000004 is not loaded", "code": 400}


def test_a_rescoring_refused_twice_in_a_row_is_the_requests_fault(servers: list[CannedServer], monkeypatch) -> None:
    """Before, every refusal (4xx) was taken for a passing state: the chunk was generated again
    every 10 s until sync_timeout, and the error then said no endpoint answered."""
    monkeypatch.setattr(sglang_endpoints, "DEAD_RETRY_S", 0.2)
    result, server = ask(servers, lambda _: canned_reply(400, ADAPTER_SWAPPED), rescore=True, deadline_s=30)
    assert isinstance(result, SGLangRequestError), repr(result)
    assert "refused 2 times in a row to score the completions it had just generated" in str(result)
    assert "is not loaded" in str(result)
    assert len(server.generate_requests) == 4  # generated twice, rescoring refused twice: no more


def test_a_rescoring_refused_once_is_tried_again(servers: list[CannedServer], monkeypatch) -> None:
    """An adapter swapped between the generation and its rescoring: the next try scores."""
    monkeypatch.setattr(sglang_endpoints, "DEAD_RETRY_S", 0.2)
    refused: list[int] = []

    def once(body: Any) -> Any:
        if not refused:
            refused.append(1)
            return canned_reply(400, ADAPTER_SWAPPED)
        return rescored([-0.2, -0.3])

    result, _ = ask(servers, once, rescore=True, deadline_s=30)
    assert isinstance(result, list) and result[0][0].logprobs == [-0.2, -0.3], repr(result)


def test_a_refusal_from_one_endpoint_is_raised_while_another_still_hangs(servers: list[CannedServer]) -> None:
    """The requests' outcomes are taken in the order they end: before, a 400 from the second
    endpoint was raised only once the first one's request had run out its whole timeout."""

    def silent(conn: Any, stopped: Any) -> None:
        stopped.wait()  # never answers (until the test ends)

    hanging = CannedServer(lambda path, body, count: silent if path == "/generate" else None)
    refusing = CannedServer(
        lambda path, body, count: (
            canned_reply(400, {"object": "error", "message": "bad top_k"}) if path == "/generate" else None
        )
    )
    servers += [hanging, refusing]
    endpoints = SGLangEndpoints([hanging.url, refusing.url], request_timeout_s=60, vocab_size=100)
    t0 = time.monotonic()
    try:
        with pytest.raises(SGLangRequestError, match="bad top_k"):
            endpoints.generate(
                [[1, 2, 3], [1, 2, 3]], {"n": 1, "max_new_tokens": 4}, want_logprobs=True, deadline=t0 + 120
            )
        assert time.monotonic() - t0 < 10
    finally:
        endpoints.close()
