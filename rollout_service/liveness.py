"""Liveness of an SGLang server that knows about weight loads in flight.

SGLang's ``/health`` waits on the weight-update lock, so while a large
``/update_weights_from_disk`` runs (minutes for a big model from network storage) it does not
answer, and a Kubernetes liveness probe on ``/health`` would restart SGLang in the middle of the
load. The sidecar knows when a load is in flight (``sglang_loading_step`` in its ``/status``:
SGLang's load call itself, not the validation and staging before it, during which an SGLang that
died or hung must still be restarted; an older sidecar's ``loading_step``): then SGLang counts as
alive. Otherwise ``/health`` decides. When the sidecar cannot be reached, or
answers anything but a well-formed ``/status`` in time, only ``/health`` decides (a sidecar
outage never hides a dead SGLang, nor kills a live one).

Bounds: each of the (at most) two HTTP calls gets ``timeout_s`` for its whole exchange, head
and body, however slowly the server drips its bytes (:func:`bounded_http.arequest`), so the
probe ends within ``2 * timeout_s`` (plus start-up); a Kubernetes ``timeoutSeconds`` above that
never cuts it short. Answers are read up to a small size limit and never decompressed; the
sidecar's JSON goes through :func:`bounded_http.parse_json`. Both URLs are checked before any
call: a malformed one is a ``ValueError`` naming the flag (the CLI's ``error: ...``, exit 2).

Imports neither torch nor sglang.
"""

from __future__ import annotations

import asyncio

import httpx

from .bounded_http import arequest
from .http_urls import check_http_url
from .protocol import ReplicaReport, step_for_version

STATUS_LIMIT_BYTES = 1 << 20
"""The sidecar's ``/status``: a few kB (its rejections are capped); more is not a sidecar."""
HEALTH_LIMIT_BYTES = 64 << 10
"""SGLang's ``/health`` answers with an empty body."""


def check_liveness(sglang_url: str, sidecar_url: str | None, *, timeout_s: float = 8.0) -> tuple[bool, str]:
    """(alive, why) for the SGLang server at ``sglang_url``, asking the sidecar at
    ``sidecar_url`` (None or empty: none) first; ends within ``2 * timeout_s``."""
    sglang_url = check_http_url(sglang_url, "--sglang-url")
    sidecar = check_http_url(sidecar_url, "--sidecar-url") if sidecar_url else None
    return asyncio.run(_probe(sglang_url, sidecar, timeout_s))


async def _probe(sglang_url: str, sidecar_url: str | None, timeout_s: float) -> tuple[bool, str]:
    async with httpx.AsyncClient() as client:  # each call sets its own bounds
        if sidecar_url:
            step = await _loading_step(client, sidecar_url, timeout_s)
            if step is not None:
                return True, f"the sidecar is loading step {step} into SGLang (/health waits on the load)"
        url = f"{sglang_url}/health"
        try:
            answer = await arequest(client, "GET", url, timeout_s=timeout_s, limit=HEALTH_LIMIT_BYTES)
        except httpx.HTTPError as exc:
            return False, f"GET {url} failed: {type(exc).__name__}: {exc}"
        if answer.status_code == 200:
            return True, f"{url} answered 200"
        return False, f"GET {url} answered {answer.status_code}: {answer.text[:200]!r}"


async def _loading_step(client: httpx.AsyncClient, sidecar_url: str, timeout_s: float) -> int | None:
    """The step the sidecar reports loading into SGLang; None when it loads none or its
    ``/status`` failed in any way (unreachable, slow, too large, not 200, malformed)."""
    try:
        answer = await arequest(client, "GET", f"{sidecar_url}/status", timeout_s=timeout_s, limit=STATUS_LIMIT_BYTES)
        if answer.status_code != 200:
            return None
        data = answer.json()
        if isinstance(data, dict) and "sglang_loading_step" in data:  # SGLang's load call itself
            return step_for_version(data["sglang_loading_step"])
        # (An older sidecar reports only loading_step: validating, staging or loading.)
        # ReplicaReport reads a step only if it is one (an int in range), never raising.
        return ReplicaReport.from_dict(data).loading_step
    except Exception:  # any failure means "sidecar unknown": /health decides
        return None
