"""Prompts at the edges of SGLang's length limits, each once a defect found by a review:

- a prompt capped below ``min_new_tokens`` got the whole batch refused (SGLang 400:
  "min_new_tokens must be in [0, max_new_tokens]"): ``min_new_tokens`` is capped with it;
- with rescoring, a prompt one token under ``max_req_input_len`` was given ``max_new_tokens=0``:
  an empty completion, on which TRL's ``is_truncated`` (``ids[-1]``) raised IndexError. It now
  gets the tokens that fit the context, and its completion is not rescored (no IS correction);
- a prompt of ``max_req_input_len`` tokens or more, which SGLang's scheduler refuses whatever is
  asked, reached SGLang and came back as its 400 for the batch: it is refused before it is sent,
  naming the prompt, the limit and what to do.
"""

from __future__ import annotations

import json
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest

from fake_sglang import CannedServer
from test_trl_review_fixes import MODELS_64, limited_server
from trainer_hooks.context_limits import ContextLimits, PromptTooLong
from trainer_hooks.sglang_endpoints import SGLangEndpoints, SGLangRequestError


def test_caps_never_leave_a_prompt_no_token_and_refuse_what_cannot_be_served() -> None:
    limits = ContextLimits(context_len=64, max_input_len=58)
    # 57 tokens: a rescore could take no new token; the context still has 7
    assert limits.caps([10, 57], 20, rescoring=True) == [20, 7]
    assert not limits.rescorable(57 + 7) and limits.rescorable(57)
    for lengths in ([10, 58], [64], [70]):
        with pytest.raises(PromptTooLong, match=rf"prompt {len(lengths) - 1} is {lengths[-1]} tokens"):
            limits.caps(lengths, 20, rescoring=False)
    with pytest.raises(PromptTooLong, match="of which 4 are speculative"):
        ContextLimits(context_len=64, max_input_len=None, reserved=4).caps([60], 20, rescoring=False)


def test_min_new_tokens_is_capped_with_max_new_tokens(servers: list[CannedServer]) -> None:
    """A scripted server (``fake_sglang.CannedServer``): what is sent; the real server's refusal of
    the old request is checked below."""
    server = limited_server(servers, models=MODELS_64, info={"max_req_input_len": 58})
    with closing(SGLangEndpoints([server.url], request_timeout_s=10)) as endpoints:
        endpoints.generate(
            [[1] * 10, [2] * 50],
            {"n": 1, "max_new_tokens": 20, "min_new_tokens": 16},
            want_logprobs=False,
            deadline=time.monotonic() + 10,
        )
    (sent,) = server.generate_requests
    assert [(p["max_new_tokens"], p["min_new_tokens"]) for p in sent["sampling_params"]] == [(20, 16), (14, 14)]


def test_a_prompt_the_server_cannot_take_is_refused_before_it_is_sent(servers: list[CannedServer]) -> None:
    server = limited_server(servers, models=MODELS_64, info={"max_req_input_len": 58})
    with closing(SGLangEndpoints([server.url], request_timeout_s=10)) as endpoints:
        with pytest.raises(SGLangRequestError) as err:
            endpoints.generate(
                [[1] * 10, [2] * 58], {"n": 1, "max_new_tokens": 4}, want_logprobs=False, deadline=time.monotonic() + 10
            )
    message = str(err.value)
    assert "prompt 1 is 58 tokens" in message and "max_req_input_len" in message
    assert "longest prompts" in message and "--context-length" in message
    assert "max_prompt_length" not in message  # (no field of TRL 1.16's GRPOConfig)
    assert server.generate_requests == []


def _max_input_len(url: str) -> int:
    return int(httpx.get(f"{url}/server_info", timeout=30).json()["max_req_input_len"])


@pytest.mark.slow
def test_real_sglang_serves_prompts_at_the_edges_of_its_limits(sglang_server_at_base, tiny_model_dir: Path) -> None:
    """Real SGLang 0.5.23 (the tiny model: context 2048)."""
    url = sglang_server_at_base.url
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    longest = _max_input_len(url)
    tokens = [10 + i % (vocab - 20) for i in range(longest)]
    short, edge = tokens[:12], tokens[: longest - 1]
    params: dict[str, Any] = {"n": 1, "max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    with closing(SGLangEndpoints([url], request_timeout_s=600, vocab_size=vocab)) as endpoints:
        # min_new_tokens above a prompt's cap: before, HTTP 400 for the batch
        capped = endpoints.generate(
            [short, edge], {**params, "min_new_tokens": 12}, want_logprobs=False, deadline=time.monotonic() + 600
        )
        assert len(capped[0][0].token_ids) == 16 and 0 < len(capped[1][0].token_ids) < 12
        # rescoring a prompt one token under the longest input: before, an empty completion
        rescored = endpoints.generate(
            [short, edge], params, want_logprobs=True, deadline=time.monotonic() + 600, rescore=True
        )
        (short_c,), (edge_c,) = rescored
        assert len(short_c.token_ids) == 16 and all(lp is not None for lp in short_c.logprobs)
        assert len(edge_c.token_ids) >= 1, "an empty completion (TRL's is_truncated reads ids[-1])"
        assert edge_c.logprobs == [None] * len(edge_c.token_ids)  # not rescored: no IS correction
        with pytest.raises(SGLangRequestError, match=rf"prompt 1 is {longest} tokens"):
            endpoints.generate([short, tokens], params, want_logprobs=False, deadline=time.monotonic() + 600)
