"""Fixes from a review of the TRL integration against TRL's own vLLM path (session 26).

1. One prompt whose length plus ``max_completion_length`` passed SGLang's context length failed
   the whole batched ``/generate`` with a 400 (so the training step and the run), where vLLM
   generates it up to the context length and reports it truncated. Each prompt now gets the
   ``max_new_tokens`` that fits (``trainer_hooks/context_limits.py``); with rescoring, prompt +
   completion stays under SGLang's longest input so the rescore is taken too.
2. ``max_staleness > 0`` trained on rollouts from older weights with nothing to correct them
   (RLOO has no importance-sampling correction; GRPO's can be off, or NaN logprobs turn it off)
   and said nothing: the config now warns, naming why.
"""

from __future__ import annotations

import logging
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from fake_sglang import CannedServer, canned_answer, canned_reply
from trainer_helpers import make_config
from trainer_hooks.config import RLOOConfig
from trainer_hooks.context_limits import ContextLimits
from trainer_hooks.sglang_endpoints import SGLangEndpoints

# --- 1. per-prompt max_new_tokens ------------------------------------------------------------------


def test_caps_give_each_prompt_what_fits_and_nothing_when_all_fit() -> None:
    limits = ContextLimits(context_len=64, max_input_len=58)
    assert limits.caps([10, 20], 20, rescoring=False) is None  # all fit: the request goes unchanged
    assert limits.caps([10, 50], 20, rescoring=False) == [20, 14]
    # a rescore sends prompt + completion as an input, which must stay under 58 tokens
    assert limits.caps([10, 50], 20, rescoring=True) == [20, 7]
    assert ContextLimits(None, 58).caps([50], 20, rescoring=False) is None
    assert ContextLimits(None, 58).caps([50], 20, rescoring=True) == [7]
    assert ContextLimits(None, None).caps([5000], 20, rescoring=True) is None


def limited_server(servers: list[CannedServer], *, models: Any, info: Any) -> CannedServer:
    """A canned SGLang (a fake: the limits' wire format is what 0.5.23 answers, see the real-server
    test below) that states its limits and answers /generate."""

    def handler(path: str, body: Any, count: int) -> Any:
        if path == "/v1/models":
            return canned_reply(200, models)
        if path == "/server_info":
            return canned_reply(200, info)
        if path == "/generate":
            return canned_reply(200, canned_answer(body))
        return None

    server = CannedServer(handler)
    servers.append(server)
    return server


MODELS_64 = {"object": "list", "data": [{"id": "m", "parent": None, "max_model_len": 64}]}


def test_a_long_prompt_is_sent_with_the_tokens_that_fit_and_the_others_as_asked(servers) -> None:
    server = limited_server(servers, models=MODELS_64, info={"max_req_input_len": 58})
    with closing(SGLangEndpoints([server.url], request_timeout_s=10)) as endpoints:
        groups = endpoints.generate(
            [[1] * 10, [2] * 50], {"n": 2, "max_new_tokens": 20}, want_logprobs=True, deadline=time.monotonic() + 10
        )
        assert len(groups) == 2
        (sent,) = server.generate_requests
        assert [p["max_new_tokens"] for p in sent["sampling_params"]] == [20, 14]
        assert all(p["n"] == 2 for p in sent["sampling_params"])  # SGLang needs one n for all
        endpoints.generate(
            [[1] * 10], {"n": 1, "max_new_tokens": 20}, want_logprobs=True, deadline=time.monotonic() + 10
        )
        assert server.generate_requests[1]["sampling_params"] == {"n": 1, "max_new_tokens": 20}
    asked = [path for method, path, body in server.requests if method == "GET"]
    assert asked.count("/v1/models") == 1 and asked.count("/server_info") == 1  # read once per endpoint


@pytest.mark.parametrize(
    "models, info",
    [({}, {}), ({"data": [{"parent": None, "max_model_len": True}]}, {"max_req_input_len": -3}), ("x", [1])],
)
def test_a_server_that_states_no_limits_gets_the_request_as_before(servers, models: Any, info: Any) -> None:
    server = limited_server(servers, models=models, info=info)
    with closing(SGLangEndpoints([server.url], request_timeout_s=10)) as endpoints:
        endpoints.generate(
            [[2] * 5000], {"n": 1, "max_new_tokens": 20}, want_logprobs=True, deadline=time.monotonic() + 10
        )
    assert server.generate_requests[0]["sampling_params"] == {"n": 1, "max_new_tokens": 20}


def test_an_adapters_card_does_not_stand_for_the_base_models_context(servers) -> None:
    models = {"data": [{"id": "lora", "parent": "m", "max_model_len": None}, MODELS_64["data"][0]]}
    server = limited_server(servers, models=models, info={})
    with closing(SGLangEndpoints([server.url], request_timeout_s=10)) as endpoints:
        endpoints.generate(
            [[2] * 60], {"n": 1, "max_new_tokens": 20}, want_logprobs=True, deadline=time.monotonic() + 10
        )
    assert server.generate_requests[0]["sampling_params"] == [{"n": 1, "max_new_tokens": 4}]


@pytest.mark.slow
def test_real_sglang_generates_and_rescores_a_batch_with_a_prompt_near_its_context(
    sglang_server_at_base, tiny_model_dir: Path
) -> None:
    """Real SGLang 0.5.23 (the tiny model: context 2048): one prompt 2040 tokens long beside a
    short one, 16 new tokens each asked. Before: HTTP 400 for the whole batch, and with a prompt +
    completion of 2043+ tokens the rescore was refused too."""
    import json

    from rollout_service.tiny_model import MAX_POSITION_EMBEDDINGS

    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    long_prompt = [10 + i % (vocab - 20) for i in range(MAX_POSITION_EMBEDDINGS - 8)]
    short_prompt = long_prompt[:12]
    params = {"n": 2, "max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    with closing(SGLangEndpoints([sglang_server_at_base.url], request_timeout_s=600, vocab_size=vocab)) as endpoints:
        plain = endpoints.generate(
            [short_prompt, long_prompt], params, want_logprobs=True, deadline=time.monotonic() + 600
        )
        rescored = endpoints.generate(
            [short_prompt, long_prompt], params, want_logprobs=True, deadline=time.monotonic() + 600, rescore=True
        )
    for groups in (plain, rescored):
        short, long_ = groups
        assert [len(c.token_ids) for c in short] == [16, 16]  # the short prompt is not cut
        assert all(0 < len(c.token_ids) < 8 for c in long_), [len(c.token_ids) for c in long_]
    # rescored: the model's own logprobs came back for every token (None would mean "not rescored")
    assert all(lp is not None for group in rescored for c in group for lp in c.logprobs)


# --- 2. staleness with nothing to correct it -----------------------------------------------------

STALE_WARNING = "nothing corrects for that here"


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and STALE_WARNING in r.getMessage()]


@pytest.mark.parametrize(
    "overrides, why",
    [
        (dict(vllm_importance_sampling_correction=False), "vllm_importance_sampling_correction=False"),
        (dict(temperature=0.7, generation_kwargs={"top_k": 1}), "temperature=0.7 and greedy"),
        (dict(temperature=0.7, generation_kwargs={"logit_bias": {"5": 1.0}}), "logit_bias"),
    ],
)
def test_grpo_with_staleness_and_no_correction_warns_naming_why(tmp_path: Path, caplog, overrides, why) -> None:
    with caplog.at_level(logging.WARNING, logger="trainer_hooks"):
        make_config(tmp_path, tmp_path, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"], max_staleness=2, **overrides)
    (message,) = _warnings(caplog)
    assert "max_staleness=2" in message and why in message, message


def test_rloo_with_staleness_warns_that_it_has_no_correction(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="trainer_hooks"):
        make_config(
            tmp_path, tmp_path, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"], config_class=RLOOConfig, max_staleness=1
        )
    (message,) = _warnings(caplog)
    assert "RLOO (RLOOConfig) has no importance-sampling correction" in message


@pytest.mark.parametrize(
    "config_class, overrides",
    [
        (None, dict(max_staleness=1)),  # GRPO's correction on (TRL's default), temperature 1
        (None, dict(max_staleness=0, vllm_importance_sampling_correction=False)),
        (RLOOConfig, dict(max_staleness=0)),
    ],
)
def test_no_warning_when_rollouts_are_on_policy_or_corrected(tmp_path: Path, caplog, config_class, overrides) -> None:
    extra = {} if config_class is None else {"config_class": config_class}
    with caplog.at_level(logging.WARNING, logger="trainer_hooks"):
        make_config(tmp_path, tmp_path, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"], **extra, **overrides)
    assert _warnings(caplog) == []


def test_limits_a_server_failed_to_give_are_asked_again_and_a_404_is_kept(servers) -> None:
    """A proxy's 503 while its server warms up said nothing for good; before, it was kept as
    "no limits" and every later long prompt failed the batch (review of session 26's change)."""
    answers = {"/v1/models": [canned_reply(503, {"error": "warming up"}), canned_reply(200, MODELS_64)]}

    def handler(path: str, body: Any, count: int) -> Any:
        if path in answers:
            queue = answers[path]
            return queue.pop(0) if len(queue) > 1 else queue[0]
        if path == "/server_info":
            return canned_reply(404, {"detail": "Not Found"})
        if path == "/generate":
            return canned_reply(200, canned_answer(body))
        return None

    server = CannedServer(handler)
    servers.append(server)
    params = {"n": 1, "max_new_tokens": 20}
    with closing(SGLangEndpoints([server.url], request_timeout_s=10)) as endpoints:
        for _ in range(3):
            endpoints.generate([[2] * 60], params, want_logprobs=True, deadline=time.monotonic() + 10)
    sent = [body["sampling_params"] for body in server.generate_requests]
    assert sent == [params, [{"n": 1, "max_new_tokens": 4}], [{"n": 1, "max_new_tokens": 4}]], sent
    asked = [path for method, path, body in server.requests if method == "GET"]
    assert asked.count("/v1/models") == 2 and asked.count("/server_info") == 1, asked


def test_caps_leave_room_for_the_draft_slots_speculative_decoding_reserves(servers) -> None:
    """SGLang 0.5.23 adds EAGLE's draft slots (max of topk x steps and the draft tokens) to each
    input's count before the context check: without room for them the batch still got the 400."""
    from trainer_hooks.context_limits import reserved_tokens

    eagle = {"speculative_algorithm": "EAGLE", "speculative_eagle_topk": 4, "speculative_num_steps": 3}
    assert reserved_tokens({**eagle, "speculative_num_draft_tokens": 8}) == 12
    assert reserved_tokens({**eagle, "speculative_num_draft_tokens": 16}) == 16
    assert reserved_tokens({"speculative_algorithm": None, "speculative_num_draft_tokens": 16}) == 0
    assert reserved_tokens({"speculative_algorithm": "EAGLE", "speculative_eagle_topk": True}) == 0
    server = limited_server(servers, models=MODELS_64, info={**eagle, "speculative_num_draft_tokens": 8})
    with closing(SGLangEndpoints([server.url], request_timeout_s=10)) as endpoints:
        endpoints.generate(
            [[2] * 40], {"n": 1, "max_new_tokens": 20}, want_logprobs=True, deadline=time.monotonic() + 10
        )
    assert server.generate_requests[0]["sampling_params"] == [{"n": 1, "max_new_tokens": 12}]
