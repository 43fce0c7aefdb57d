"""Fixes from a review of the trainer side: the retry budget, poison counting, gateway answers,
sampling values refused when the trainer is built, evaluation's syncs, and the collective budget.

The HTTP-level tests run SGLang's ``POST /generate`` through ``httpx.MockTransport`` (a fake SGLang:
a round of generation that outlasts ``sync_timeout``, a replica that dies at the end of its chunk,
a proxy's 504 and a transient 500 cannot be had from a real server on demand). Their clock is a
:class:`FakeClock` that a request moves forward, so a "40-minute round" takes no time and nothing
depends on the machine's speed. The evaluation test runs TRL's real ``GRPOTrainer`` against the
in-process fake SGLang and sidecar (``fake_sglang.FakeRollout``; a real SGLang is not started in
these tests).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

import trainer_hooks.sglang_endpoints as endpoints_module
import trainer_hooks.stale_retry as stale_module
from fake_sglang import VOCAB_SIZE, FakeRollout
from trainer_helpers import NoWaiter, make_config, make_trainer, prompts_dataset
from trainer_hooks.checkpoint_publisher import background_sync_bound_s
from trainer_hooks.config import (
    COLLECTIVE_MARGIN_S,
    adapt_trl_fields,
    collective_budget_s,
    generation_budget_s,
    translate_generation_kwargs,
)
from trainer_hooks.sampling_checks import check_token_ids_in_vocab
from trainer_hooks.sglang_endpoints import (
    POISON_RETRIES,
    SGLangEndpoints,
    SGLangPoisonRequestError,
    SGLangUnavailableError,
)
from trainer_hooks.stale_retry import StaleRetryPolicy

REQUEST_TIMEOUT_S = 3600.0
"""Longer than any fake round, so no request counts as timed out unless a test says so."""


class FakeClock:
    """Stands in for the ``time`` module of the endpoints and the retry policy: ``monotonic()``
    starts at 1000 and moves only when a test says so (``advance``) or the code sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))


@pytest.fixture(autouse=True)
def closed_endpoints(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every ``SGLangEndpoints`` a test makes is closed after it: its request threads would
    otherwise outlive the test (and count as left running in later tests' checks)."""
    made: list[SGLangEndpoints] = []
    real_init = SGLangEndpoints.__init__

    def init(self: SGLangEndpoints, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(SGLangEndpoints, "__init__", init)
    yield
    for endpoints in made:
        endpoints.close()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(endpoints_module, "time", fake)
    monkeypatch.setattr(stale_module, "time", fake)
    return fake


def answer(body: dict[str, Any], finish: str = "length") -> list[dict[str, Any]]:
    """SGLang's answer to ``body``: per prompt and sample, its first token, version "1"."""
    out = []
    for prompt in body["input_ids"]:
        for _ in range(int(body["sampling_params"].get("n", 1))):
            out.append(
                {
                    "output_ids": [prompt[0]],
                    "meta_info": {
                        "weight_version": "1",
                        "prompt_tokens": len(prompt),
                        "output_token_logprobs": [[-0.5, prompt[0], None]],
                        "finish_reason": {"type": finish},
                    },
                }
            )
    return out


class Servers:
    """A fake SGLang per host behind one ``httpx.MockTransport``: ``behave(host, body, count)``
    returns the answer of that host's ``count``-th ``/generate`` (or raises, as a dropped connection);
    ``/health`` answers ``health`` (a dead server: 503)."""

    def __init__(self, behave: Any, health: int = 503) -> None:
        self.behave = behave
        self.health = health
        self.requests: list[tuple[str, list[list[int]]]] = []
        self._lock = threading.Lock()

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(self.health)
        body = json.loads(request.content)
        host = request.url.host
        with self._lock:
            self.requests.append((host, body["input_ids"]))
            count = sum(1 for h, _ in self.requests if h == host)
        return self.behave(host, body, count)

    def endpoints(self, *hosts: str) -> SGLangEndpoints:
        return SGLangEndpoints(
            [f"http://{h}:1" for h in hosts],
            request_timeout_s=REQUEST_TIMEOUT_S,
            transport=httpx.MockTransport(self.handle),
        )


PARAMS = {"n": 2, "max_new_tokens": 4}


# --- 1. the retry budget starts at the first failure ------------------------------------------------


def test_a_dead_replicas_prompts_go_to_a_healthy_one_after_a_round_longer_than_the_budget(clock: FakeClock) -> None:
    # Each round takes 100 s; the call was given 10 s. Replica b dies at the end of its chunk: its prompt
    # must go to replica a, which answered, not fail the step at once.
    def behave(host: str, body: dict[str, Any], count: int) -> httpx.Response:
        clock.advance(100)
        if host == "b":
            raise httpx.ReadError("connection reset")
        return httpx.Response(200, json=answer(body))

    servers = Servers(behave)
    groups = servers.endpoints("a", "b").generate([[1, 2], [3, 4]], PARAMS, want_logprobs=True, deadline=clock.now + 10)
    assert [[c.token_ids[0] for c in g] for g in groups] == [[1, 1], [3, 3]]
    assert sorted(servers.requests[:2]) == [("a", [[1, 2]]), ("b", [[3, 4]])]
    assert servers.requests[2:] == [("a", [[3, 4]])]


def test_the_budget_is_granted_once_from_the_first_failure_not_from_every_one(clock: FakeClock) -> None:
    # Every request fails after 100 s (a timeout: never a poison candidate) and the budget is 10 s:
    # the first failure grants 10 s more, so exactly one retry is sent, and none after the second failure.
    def behave(host: str, body: dict[str, Any], count: int) -> httpx.Response:
        clock.advance(100)
        raise httpx.ReadTimeout("no answer")

    servers = Servers(behave)
    with pytest.raises(SGLangUnavailableError, match="retry budget ran out"):
        servers.endpoints("a").generate([[1, 2]], PARAMS, want_logprobs=True, deadline=clock.now + 10)
    assert len(servers.requests) == 2


def test_an_aborted_group_is_generated_again_after_a_round_longer_than_sync_timeout(clock: FakeClock) -> None:
    # sync_timeout 10 s, a round of 100 s that aborts one group: it is generated again (before: "SGLang kept
    # aborting ... until sync_timeout ran out" after the one attempt).
    def behave(host: str, body: dict[str, Any], count: int) -> httpx.Response:
        clock.advance(100)
        out = answer(body)
        if count == 1:
            out[0]["meta_info"]["finish_reason"] = {"type": "abort"}
        return httpx.Response(200, json=out)

    servers = Servers(behave)
    policy = _policy(servers.endpoints("a"), sync_timeout=10)
    groups, record = policy.generate([[1, 2], [3, 4]], PARAMS, want_logprobs=True, rescore=False)
    assert all(c.finish_reason != "abort" for g in groups for c in g)
    assert record.stale_retries == 1
    assert [prompts for _, prompts in servers.requests] == [[[1, 2], [3, 4]], [[1, 2]]]


def test_an_endpoint_that_answered_is_reported_as_answered_not_as_not_tried(clock: FakeClock) -> None:
    # a, b and c share three prompts; b dies on its own. Its prompt goes to a (c gets none that round),
    # and a's request outlasts the budget. c answered its prompt: the error must not say "not tried".
    def behave(host: str, body: dict[str, Any], count: int) -> httpx.Response:
        if host == "b" or (host == "a" and count == 2):
            clock.advance(100)
            raise httpx.ReadTimeout("no answer")
        return httpx.Response(200, json=answer(body))

    servers = Servers(behave)
    with pytest.raises(SGLangUnavailableError) as caught:
        servers.endpoints("a", "b", "c").generate(
            [[1, 2], [3, 4], [5, 6]], PARAMS, want_logprobs=True, deadline=clock.now + 10
        )
    message = str(caught.value)
    assert "http://c:1: answered its last request" in message, message
    assert "not tried" not in message, message


def test_the_collective_budget_covers_the_longest_generate(clock: FakeClock) -> None:
    # The worst generate: the first round runs (almost) its whole request timeout and fails, retries run
    # for sync_timeout after that, and a round in flight then runs its whole timeout too.
    sync_timeout, request_timeout = 100.0, 1000.0

    def behave(host: str, body: dict[str, Any], count: int) -> httpx.Response:
        clock.advance(request_timeout - 1)
        raise httpx.ReadTimeout("no answer")

    servers = Servers(behave)
    endpoints = SGLangEndpoints(
        ["http://a:1"], request_timeout_s=request_timeout, transport=httpx.MockTransport(servers.handle)
    )
    policy = _policy(endpoints, sync_timeout)
    started = clock.now
    with pytest.raises(SGLangUnavailableError):
        policy.generate([[1, 2]], PARAMS, want_logprobs=True, rescore=False)
    spent = clock.now - started
    assert spent > sync_timeout + request_timeout + COLLECTIVE_MARGIN_S  # what the old budget allowed
    assert spent <= generation_budget_s(sync_timeout, request_timeout, rescoring=False)
    assert spent + COLLECTIVE_MARGIN_S <= collective_budget_s(sync_timeout, request_timeout, rescoring=False)


class _Published:
    """A publisher that published version 1 (what the fake answers with)."""

    latest_version = 1
    first_version = 1

    def version_back(self, publishes: int) -> int:
        return 1

    def raise_if_failed(self) -> None:
        pass


def _policy(endpoints: SGLangEndpoints, sync_timeout: float) -> StaleRetryPolicy:
    """The retry policy over ``endpoints``, version 1 published (max_staleness 0), no replicas to wait for."""
    return StaleRetryPolicy(
        endpoints, cast(Any, _Published()), NoWaiter(), max_staleness=0, sync_timeout_s=sync_timeout
    )


# --- 2. and 3. what counts toward the poison limit -----------------------------------------------------


def _fails_first(status: int | None) -> Any:
    """The first /generate fails (HTTP ``status``; None: the connection drops), later ones answer."""

    def behave(host: str, body: dict[str, Any], count: int) -> httpx.Response:
        if count == 1:
            if status is None:
                raise httpx.ReadError("connection reset")
            return httpx.Response(status, text="transient failure")
        return httpx.Response(200, json=answer(body))

    return behave


@pytest.mark.parametrize("status", [500, None], ids=["http-500", "dropped-connection"])
def test_a_prompt_that_occurs_twice_in_the_batch_counts_once_per_failure(clock: FakeClock, status: int | None) -> None:
    # One transient failure of a batch holding the same prompt twice is one failure, not the second one
    # that makes it a poison request.
    servers = Servers(_fails_first(status), health=200)
    groups = servers.endpoints("a").generate([[1, 2], [1, 2]], PARAMS, want_logprobs=True, deadline=clock.now + 60)
    assert len(groups) == 2 and len(servers.requests) == 2


@pytest.mark.parametrize("status", [502, 504])
def test_a_gateway_error_is_retried_and_never_counted_as_a_poison_request(clock: FakeClock, status: int) -> None:
    # A router or proxy (healthy itself) answers 502/504 twice, then its upstream answers.
    def behave(host: str, body: dict[str, Any], count: int) -> httpx.Response:
        if count <= 2:
            return httpx.Response(status, text=f"<html>{status} from the gateway</html>")
        return httpx.Response(200, json=answer(body))

    servers = Servers(behave, health=200)
    groups = servers.endpoints("router").generate([[1, 2]], PARAMS, want_logprobs=True, deadline=clock.now + 60)
    assert len(groups) == 1 and len(servers.requests) == 3


def test_a_gateway_error_from_a_server_that_died_counts_as_a_poison_request(clock: FakeClock) -> None:
    """Behind nginx, a request that kills SGLang comes back as 502 and /health then fails through
    the proxy too: that request is what killed it, and it is not sent a third time (each send
    would kill the server again, spending its supervisor's restart budget)."""

    def behave(host: str, body: dict[str, Any], count: int) -> httpx.Response:
        return httpx.Response(502, text="<html>502 Bad Gateway</html>")

    servers = Servers(behave, health=502)
    endpoints = servers.endpoints("proxy")
    with pytest.raises(SGLangPoisonRequestError, match="502"):
        endpoints.generate([[1, 2]], PARAMS, want_logprobs=True, deadline=clock.now + 600)
    assert len(servers.requests) == POISON_RETRIES + 1


# --- 4. sampling values SGLang refuses or crashes on -----------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"json_schema": {"type": "object"}}, r"json_schema must be a string: the schema as JSON text, json.dumps"),
        ({"structural_tag": {"begin": "<a>"}}, r"structural_tag must be a string: .*json.dumps\(tag\)"),
        ({"regex": 5}, r"generation_kwargs regex must be a string \(SGLang takes the grammar as text\), got 5"),
        ({"ebnf": ["root ::= 'a'"]}, r"generation_kwargs ebnf must be a string"),
        ({"stop_regex": [3]}, r"generation_kwargs stop_regex must be a string or a list of strings"),
        ({"logit_bias": {"abc": 1.0}}, r"logit_bias must be a dict of token id -> bias"),
        ({"logit_bias": {"5": "high"}}, r"logit_bias must be a dict of token id -> bias"),
        ({"logit_bias": {"-5": 1.0}}, r"logit_bias must be a dict of token id -> bias"),
        ({"logit_bias": [5, -100.0]}, r"logit_bias must be a dict of token id -> bias"),
        ({"custom_params": "x"}, r"custom_params must be a dict with string keys"),
        ({"custom_params": {"k": object()}}, r"custom_params must be a dict with string keys"),
        ({"stream_interval": "x"}, r"stream_interval must be a whole number >= 1, got 'x'"),
        ({"stream_interval": 1.5}, r"stream_interval must be a whole number >= 1"),
    ],
)
def test_a_value_of_a_type_sglang_cannot_take_is_refused_naming_the_key(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        translate_generation_kwargs(kwargs)


def test_values_of_the_types_sglang_takes_pass() -> None:
    kwargs = {
        "json_schema": '{"type": "object"}',
        "stop_regex": ["\\d+"],
        "logit_bias": {"5": -100.0, 7: 2},
        "custom_params": {"a": 1, "b": [1, "x", None], "c": {"d": True}},
        "stream_interval": 4,
    }
    assert translate_generation_kwargs(dict(kwargs)) == kwargs


def test_sglangs_grammar_cache_cannot_take_a_dict_schema() -> None:
    # Why a dict is refused: SGLang keys its grammar cache by (kind, the grammar), which must hash.
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(json_schema={"type": "object"})
    with pytest.raises(TypeError, match="unhashable"):
        hash(("json", params.json_schema))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stop_token_ids": [3, VOCAB_SIZE + 903]}, rf"stop_token_ids has token id {VOCAB_SIZE + 903}, outside"),
        ({"logit_bias": {str(VOCAB_SIZE): -100.0}}, rf"logit_bias has token id {VOCAB_SIZE}, outside"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message + rf" the model's vocabulary \(0 .. {VOCAB_SIZE - 1}\)"):
        check_token_ids_in_vocab(kwargs, VOCAB_SIZE)
    check_token_ids_in_vocab(kwargs, None)  # vocabulary not known: left to SGLang
    check_token_ids_in_vocab({"stop_token_ids": [VOCAB_SIZE - 1], "logit_bias": {"0": 1.0}}, VOCAB_SIZE)


def test_the_trainer_refuses_the_stop_token_that_kills_sglang(tiny_model_dir: Path, tmp_path: Path) -> None:
    # min_new_tokens > 0 with a stop token outside the vocabulary kills SGLang 0.5.23 (test_poison_request);
    # the trainer knows the model's vocabulary when it is built, before any request.
    config = make_config(
        tmp_path,
        tmp_path,
        ["http://127.0.0.1:9"],
        ["http://127.0.0.1:9"],
        generation_kwargs={"min_new_tokens": 2, "stop_token_ids": [VOCAB_SIZE + 903]},
    )
    with pytest.raises(ValueError, match=rf"stop_token_ids has token id {VOCAB_SIZE + 903}, outside the model's"):
        make_trainer(tiny_model_dir, config)


# --- 5. evaluation generates with the newest weights --------------------------------------------------


@pytest.mark.parametrize("how", ["evaluate", "predict"])
def test_evaluate_after_train_syncs_the_final_weights_before_generating(
    tiny_model_dir: Path, tmp_path: Path, fake: FakeRollout, how: str
) -> None:
    """After train() with max_staleness=1, evaluate() (and predict(), session 26) must generate with the
    final step's weights and leave no sync running. The fake sidecar's /wait confirms a version when it
    is asked (fake_sglang's FakeRollout, not a real SGLang: none is started here); a sync in the
    background is held back until evaluate() returned, as a slow replica would be, so one left in the
    background shows in the versions that answered and in the publisher still busy."""
    trainer = make_trainer(
        tiny_model_dir, make_config(tmp_path, tmp_path, [fake.url], [fake.url], max_steps=2, max_staleness=1)
    )
    trainer.train()
    generation = trainer.vllm_generation
    publisher = generation.publisher
    evaluated = threading.Event()
    real_wait = publisher.waiter.wait

    def wait(version: int, timeout_s: float) -> Any:
        if threading.current_thread().name.startswith("checkpoint-sync"):
            evaluated.wait(30)
        return real_wait(version, timeout_s)

    publisher.waiter.wait = wait
    before, seen = publisher.latest_version, len(generation.history)
    try:
        if how == "evaluate":
            trainer.evaluate(eval_dataset=prompts_dataset(4))
        else:
            trainer.predict(prompts_dataset(4))
        busy = publisher.busy
    finally:
        evaluated.set()
    records = list(generation.history)[seen:]
    assert records and publisher.latest_version == before + 1  # evaluation published the final weights
    assert {v for r in records for v in r.versions} == {publisher.latest_version}, records
    # ... and only the newest is accepted (a replica not waited for may serve an older one).
    assert {r.required_version for r in records} == {publisher.latest_version}, records
    assert generation.rollouts.newest_only is False  # training takes max_staleness again
    assert not busy


# --- 6. the collective budget counts the wait for the previous background sync ---------------------


def test_the_collective_budget_covers_the_wait_for_the_previous_background_sync() -> None:
    sync_timeout, request_timeout = 1000.0, 60.0
    waited = background_sync_bound_s(sync_timeout, 0) + sync_timeout  # then it raises RootUnresponsive
    assert collective_budget_s(sync_timeout, request_timeout, False, background_syncs=True) >= waited
    assert collective_budget_s(sync_timeout, request_timeout, False, background_syncs=False) < waited
    gigabytes = 20 * 10**9
    assert (
        collective_budget_s(sync_timeout, request_timeout, False, background_syncs=True, checkpoint_bytes=gigabytes)
        >= background_sync_bound_s(sync_timeout, gigabytes) + sync_timeout
    )


def test_ddp_timeout_is_raised_to_cover_the_wait_for_the_previous_background_sync(tmp_path: Path) -> None:
    config = make_config(
        tmp_path, tmp_path, ["http://127.0.0.1:9"], ["http://127.0.0.1:9"], sync_timeout=1000.0, max_staleness=1
    )
    config.use_cpu = False
    config.sglang_request_timeout = 60.0
    adapt_trl_fields(config, world_size=2)
    assert config.ddp_timeout >= background_sync_bound_s(1000.0, 0) + 1000.0 + COLLECTIVE_MARGIN_S


def test_on_cpu_a_sync_timeout_the_background_wait_does_not_fit_under_torchs_default_is_refused(
    tmp_path: Path,
) -> None:
    config = make_config(
        tmp_path, tmp_path, ["http://127.0.0.1:9"], ["http://127.0.0.1:9"], sync_timeout=600.0, max_staleness=1
    )
    with pytest.raises(ValueError, match=r"lower sync_timeout to at most 480 s, or set max_staleness=0"):
        adapt_trl_fields(config, world_size=2)


def test_the_trainer_warns_when_the_models_checkpoint_outgrows_the_collective_budget(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The config's budget counts no checkpoint bytes (no model yet); the trainer knows them. A 40 GB
    # checkpoint (a 1e10-parameter layer on the meta device: no memory) takes 4000 s at 10 MB/s.
    import torch

    from trainer_hooks.trainer import _warn_if_a_sync_outlasts_the_process_group

    config = make_config(tmp_path, tmp_path, ["http://127.0.0.1:9"], ["http://127.0.0.1:9"], max_staleness=1)
    config.use_cpu = False
    adapt_trl_fields(config, world_size=2)  # ddp_timeout raised to the budget without the bytes
    small, large = torch.nn.Linear(4, 4), torch.nn.Linear(100_000, 100_000, bias=False, device="meta")
    caplog.set_level("WARNING", logger="trainer_hooks.trainer")
    caplog.clear()
    _warn_if_a_sync_outlasts_the_process_group(config, small, "float32", processes=2)
    _warn_if_a_sync_outlasts_the_process_group(config, large, "float32", processes=1)  # no collective
    assert not caplog.records
    _warn_if_a_sync_outlasts_the_process_group(config, large, "float32", processes=2)
    [line] = [r.getMessage() for r in caplog.records if r.name == "trainer_hooks.trainer"]
    expected = collective_budget_s(
        config.sync_timeout, config.sglang_request_timeout, False, background_syncs=True, checkpoint_bytes=4 * 10**10
    )
    assert "(40.0 GB)" in line and f"Raise ddp_timeout to {int(expected) + 1} s" in line, line
