"""HTTP details shared by the sidecar and the trainer: bearer-token headers, loopback hosts."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlparse, urlsplit

from .redaction import remember_secret

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
"""Hosts that only this machine can reach."""

MAX_TOKEN_CHARS = 4096
"""Longest accepted token: HTTP servers refuse much larger headers."""

PLACEHOLDER_PREFIX = "REPLACE_WITH_"
"""How the example credentials start (deploy/compose/.env.example, the example Kubernetes Secret)."""

GENERATE_TOKEN = """python3 -c 'import secrets; print(secrets.token_hex(32))'"""
"""The command the deployment docs give for making a token."""


def check_token(token: str | None, name: str) -> str | None:
    """``token`` when an HTTP header can carry it; else ValueError naming the setting ``name``.

    A header is latin-1 on the wire and a bearer token a single word: a token must be printable
    ASCII without spaces, at most :data:`MAX_TOKEN_CHARS` characters. None (no token) passes; ""
    is refused: an empty ``--token ''`` would silently mean no authentication at all.
    An example file's placeholder (:data:`PLACEHOLDER_PREFIX`) is refused: it is published, so a
    deployment that kept it would guard its endpoints with a token everyone knows.
    """
    if token is None:
        return token
    if not isinstance(token, str):
        raise ValueError(f"{name} must be a string, got {type(token).__name__}")
    if not token:
        raise ValueError(
            f"{name} is empty, which would mean no token at all: give a token (e.g. the output of"
            f" `{GENERATE_TOKEN}`), or leave {name} unset to run without one"
        )
    if len(token) > MAX_TOKEN_CHARS:
        raise ValueError(f"{name} is {len(token)} characters long; use a token of at most {MAX_TOKEN_CHARS}")
    if token.startswith(PLACEHOLDER_PREFIX):
        raise ValueError(
            f"{name} is still the example's placeholder ({PLACEHOLDER_PREFIX}...), which anyone can read in"
            f" this project's files: generate a token, e.g. `{GENERATE_TOKEN}`, and set that instead"
        )
    bad = next((c for c in token if not "!" <= c <= "~"), None)
    if bad is not None:
        raise ValueError(
            f"{name} contains {bad!r}, which an HTTP header cannot carry in a bearer token: use printable"
            " ASCII without spaces (e.g. the output of `openssl rand -hex 32`)"
        )
    remember_secret(token)  # logs and error messages never show it, whatever it holds
    return token


def bearer_headers(token: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <token>"}``, or no header when there is no token.

    A token :func:`check_token` refuses raises ValueError here (not a UnicodeEncodeError later).
    """
    return {"Authorization": f"Bearer {check_token(token, 'the bearer token')}"} if token else {}


def is_loopback_url(url: str | None) -> bool:
    """True for a URL whose host is this machine (the server runs here)."""
    return bool(url) and is_loopback_host(urlparse(str(url)).hostname)


LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
"""Names /etc/hosts gives this machine's loopback addresses (Debian, Red Hat)."""


def is_loopback_host(host: str | None) -> bool:
    """Whether ``host`` (a bind address, or a name from a URL or a Host header, without port or
    brackets) is this machine only: ``localhost`` (:data:`LOOPBACK_NAMES`), ``127.0.0.0/8`` in any
    form the C library reads (``127.1``), ``::1``, ``::ffff:127.0.0.1``."""
    if not host:
        return False
    name = host.lower().removesuffix(".")  # "localhost." is localhost
    if name in LOOPBACK_HOSTS or name in LOOPBACK_NAMES:
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        try:  # the short IPv4 forms a browser and curl accept ("127.1")
            return name.replace(".", "").isdigit() and socket.inet_aton(name)[0] == 127
        except OSError:
            return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def is_loopback_authority(value: str) -> bool:
    """Whether a Host header's ``value`` (``127.0.0.1:8100``, ``[::1]:8100``, ``localhost``) names
    this machine only; anything else (another name, user info, a bad port) is not."""
    if not value or any(c in value for c in "@/?#\\") or any(not "!" <= c <= "~" for c in value):
        return False
    try:
        parts = urlsplit(f"//{value}")
        parts.port  # noqa: B018 - a port that is no number raises ValueError
    except ValueError:
        return False
    return is_loopback_host(parts.hostname)
