"""HTTP details shared by the sidecar and the trainer: bearer-token headers, loopback hosts."""

from __future__ import annotations

from urllib.parse import urlparse

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
"""Hosts that only this machine can reach."""


def bearer_headers(token: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <token>"}``, or no header when there is no token."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def is_loopback_url(url: str | None) -> bool:
    """True for a URL whose host is this machine (the server runs here)."""
    return bool(url) and urlparse(url).hostname in LOOPBACK_HOSTS
