"""Helpers shared by the test modules: talking to a real SGLang server over HTTP.

Kept free of torch and sglang imports so that sidecar-only tests can use them too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from rollout_service.sglang_launcher import free_port

__all__ = ["free_port", "generate"]

GENERATE_TIMEOUT_S = 300.0
"""Generous: the CI machines have two cores and other jobs share them."""


def generate(
    url: str,
    input_ids: Sequence[int] | Sequence[Sequence[int]],
    max_new_tokens: int = 16,
    *,
    temperature: float = 0.0,
    n: int = 1,
    ignore_eos: bool = False,
    return_logprob: bool = False,
    timeout_s: float = GENERATE_TIMEOUT_S,
    **sampling_params: Any,
) -> Any:
    """POST /generate and return the decoded JSON.

    `input_ids` is one prompt (a list of ints; SGLang then answers one object) or a batch
    (a list of lists; SGLang answers a flat list ordered prompt by prompt, `n` items each).
    Extra keyword arguments go into `sampling_params`.
    """
    params = {
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "n": n,
        "ignore_eos": ignore_eos,
        **sampling_params,
    }
    payload = {"input_ids": input_ids, "sampling_params": params, "return_logprob": return_logprob}
    response = httpx.post(f"{url}/generate", json=payload, timeout=timeout_s)
    if response.status_code != 200:
        raise AssertionError(
            f"POST {url}/generate answered {response.status_code}, expected 200: {response.text[:2000]}"
        )
    return response.json()
