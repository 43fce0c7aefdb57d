"""An SGLang restarted with a smaller context, between two requests, is asked with its new limits.

The trainer reads each server's length limits once and caps every prompt's ``max_new_tokens``
to fit them (``trainer_hooks/context_limits.py``). A server that came back on the same address
with a smaller ``--context-length`` (no failed request in between, so nothing told the trainer)
answered the next batch with its 400 "exceeds the model's maximum context length", and training
stopped. Such a 400 now makes the trainer read the limits again and, if they changed, send the
batch once more, capped to them. A prompt that does not fit the limits it already knew still gets
SGLang's own 400.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from conftest import SERVER_EXTRA_ARGS, SERVER_HEALTH_TIMEOUT_S
from fake_sglang import CannedServer, canned_reply
from helpers import free_port
from rollout_service.sglang_launcher import SGLangServer
from trainer_hooks.sglang_endpoints import SGLangEndpoints, SGLangRequestError

SMALL_CONTEXT = 256


def _server(model: Path, port: int, log_path: Path, *context: str) -> SGLangServer:
    server = SGLangServer(
        model,
        device="cpu",
        port=port,
        python=sys.executable,
        log_path=log_path,
        extra_args=(*SERVER_EXTRA_ARGS, *context),
        die_with_parent=True,
    )
    server.start()
    try:
        server.wait_healthy(SERVER_HEALTH_TIMEOUT_S)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.mark.sglang
def test_real_sglang_restarted_with_a_smaller_context_gets_capped_requests(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    port = free_port()
    prompt = [10 + i % (vocab - 20) for i in range(SMALL_CONTEXT - 16)]
    params = {"n": 1, "max_new_tokens": 32, "temperature": 1.0, "ignore_eos": True}
    server = _server(tiny_model_dir, port, tmp_path / "first.log")
    with closing(SGLangEndpoints([server.url], request_timeout_s=300, vocab_size=vocab)) as endpoints:
        try:
            (first,) = endpoints.generate([prompt], params, want_logprobs=True, deadline=time.monotonic() + 300)
            assert [len(c.token_ids) for c in first] == [32]  # the launch context (2048) fits it whole
        finally:
            server.stop()
        server = _server(tiny_model_dir, port, tmp_path / "second.log", "--context-length", str(SMALL_CONTEXT))
        try:
            (second,) = endpoints.generate([prompt], params, want_logprobs=True, deadline=time.monotonic() + 300)
            assert 0 < len(second[0].token_ids) <= 16, len(second[0].token_ids)
            # A prompt that alone fills the new context is refused before it is sent (the limits
            # read again first: they did not change).
            with pytest.raises(SGLangRequestError, match="context length"):
                endpoints.generate([prompt + prompt], params, want_logprobs=False, deadline=time.monotonic() + 300)
        finally:
            server.stop()


def test_a_context_refusal_with_unchanged_limits_is_sent_once(servers: list[CannedServer]) -> None:
    """A scripted server (``fake_sglang.CannedServer``): how many requests a refusal costs, which
    the real server does not report. Its limits are read again, once, and the batch not resent."""
    refusal = {"object": "error", "message": "Requested token count exceeds the model's maximum context length of 64"}

    def handler(path: str, body: Any, count: int) -> Any:
        if path == "/v1/models":
            return canned_reply(200, {"data": [{"id": "m", "max_model_len": 64}]})
        if path == "/server_info":
            return canned_reply(200, {})
        if path == "/generate":
            return canned_reply(400, refusal)
        return None

    server = CannedServer(handler)
    servers.append(server)
    with closing(SGLangEndpoints([server.url], request_timeout_s=10)) as endpoints:
        with pytest.raises(SGLangRequestError, match="maximum context length"):
            endpoints.generate(
                [[2] * 10], {"n": 1, "max_new_tokens": 8}, want_logprobs=False, deadline=time.monotonic() + 10
            )
    assert len(server.generate_requests) == 1
    assert [path for _, path, _ in server.requests].count("/v1/models") == 2  # read again after the refusal


def _server_whose_limits_change(servers: list[CannedServer], infos: list[dict[str, Any]], refusal: str | None):
    """A scripted server (``fake_sglang.CannedServer``) that states the limits ``infos`` in turn
    (the last from then on), refuses the first /generate with ``refusal`` (if given), answers the rest."""
    from fake_sglang import canned_answer

    reads: list[int] = []

    def handler(path: str, body: Any, count: int) -> Any:
        if path == "/v1/models":
            return canned_reply(200, {"data": [{"id": "m", "max_model_len": 8192}]})
        if path == "/server_info":
            reads.append(count)
            return canned_reply(200, infos[min(len(reads), len(infos)) - 1])
        if path == "/generate":
            if refusal is not None and len(server.generate_requests) == 1:
                return canned_reply(400, {"object": "error", "message": refusal})
            return canned_reply(200, canned_answer(body))
        return None

    server = CannedServer(handler)
    servers.append(server)
    return server, reads


def test_limits_that_grew_are_read_again_before_a_prompt_is_refused(servers: list[CannedServer]) -> None:
    """SGLang restarted with a larger KV pool (its max_req_input_len grew) and no request failed:
    a prompt the old limits refused is sent, not refused from limits read before the restart."""
    server, reads = _server_whose_limits_change(servers, [{"max_req_input_len": 58}, {"max_req_input_len": 4090}], None)
    with closing(SGLangEndpoints([server.url], request_timeout_s=10)) as endpoints:
        endpoints.generate(
            [[2] * 10], {"n": 1, "max_new_tokens": 8}, want_logprobs=False, deadline=time.monotonic() + 10
        )
        endpoints.generate(
            [[2] * 100], {"n": 1, "max_new_tokens": 8}, want_logprobs=False, deadline=time.monotonic() + 10
        )
    assert len(reads) == 2 and len(server.generate_requests) == 2


def test_an_input_refused_by_the_scheduler_makes_the_limits_read_again(servers: list[CannedServer]) -> None:
    """SGLang's scheduler says "exceeds the maximum allowed length" (its max_req_input_len shrank,
    the context did not): the limits are read again and the prompt refused here, naming it."""
    refusal = "Input length (60 tokens) exceeds the maximum allowed length (58 tokens). Use a shorter input"
    server, reads = _server_whose_limits_change(
        servers, [{"max_req_input_len": 4090}, {"max_req_input_len": 58}], refusal
    )
    with closing(SGLangEndpoints([server.url], request_timeout_s=10)) as endpoints:
        with pytest.raises(SGLangRequestError, match="prompt 0 is 60 tokens long"):
            endpoints.generate(
                [[2] * 60], {"n": 1, "max_new_tokens": 8}, want_logprobs=False, deadline=time.monotonic() + 10
            )
    assert len(reads) == 2 and len(server.generate_requests) == 1
