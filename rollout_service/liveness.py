"""Liveness of an SGLang server that knows about weight loads in flight.

SGLang's ``/health`` waits on the weight-update lock, so while a large
``/update_weights_from_disk`` runs (minutes for a big model from network storage) it does not
answer, and a Kubernetes liveness probe on ``/health`` would restart SGLang in the middle of the
load. The sidecar knows when a load is in flight (``loading_step`` in its ``/status``): then
SGLang counts as alive. Otherwise ``/health`` decides. When the sidecar cannot be reached, only
``/health`` decides (a sidecar outage never hides a dead SGLang, nor kills a live one).

Imports neither torch nor sglang.
"""

from __future__ import annotations

import httpx


def check_liveness(sglang_url: str, sidecar_url: str | None, *, timeout_s: float = 8.0) -> tuple[bool, str]:
    """(alive, why) for the SGLang server at ``sglang_url``."""
    sglang_url = sglang_url.rstrip("/")
    timeout = httpx.Timeout(timeout_s, connect=min(2.0, timeout_s))
    with httpx.Client(timeout=timeout) as client:
        if sidecar_url:
            try:
                status = client.get(f"{sidecar_url.rstrip('/')}/status").json()
            except (httpx.HTTPError, ValueError):
                status = None
            if isinstance(status, dict) and status.get("loading_step") is not None:
                return True, (
                    f"the sidecar is loading step {status['loading_step']} into SGLang (/health waits on the load)"
                )
        try:
            response = client.get(f"{sglang_url}/health")
        except httpx.HTTPError as exc:
            return False, f"GET {sglang_url}/health failed: {type(exc).__name__}: {exc}"
        if response.status_code == 200:
            return True, f"{sglang_url}/health answered 200"
        return False, f"GET {sglang_url}/health answered {response.status_code}: {response.text[:200]}"
