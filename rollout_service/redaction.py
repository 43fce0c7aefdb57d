"""Keeping credentials out of logs, error messages and status answers.

SGLang's ``--api-key`` (given after ``--`` to ``serve``, and by the demo) travels on command lines
that are logged, and SGLang logs its own arguments (``server_args=...api_key='...'``) into the log
whose tail the sidecar and ``serve`` quote when SGLang fails. Every such line goes through
:func:`shown_command` or :func:`redact_text` first: a credential's value becomes ``***``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

SGLANG_CREDENTIAL_OPTIONS = {"--api-key": "--ap", "--admin-api-key": "--ad", "--ssl-keyfile-password": "--ssl-keyfile-"}
"""SGLang 0.5.23's options whose value is a credential, each with the shortest abbreviation its
parser takes for it (argparse's ``allow_abbrev``: ``--api-ke KEY`` is ``--api-key KEY``)."""


def spellings(option: str, shortest: str) -> tuple[str, ...]:
    """``option`` and each abbreviation of it down to ``shortest``: SGLang's parser takes any
    prefix of an option that no other option shares (argparse's ``allow_abbrev``)."""
    return tuple(option[:n] for n in range(len(shortest), len(option) + 1))


_ABBREVIATED = "|".join(
    rf"(?<=(?<![\w-]){re.escape(s)})"
    for option, shortest in SGLANG_CREDENTIAL_OPTIONS.items()
    for s in spellings(option, shortest)
)
_CREDENTIAL_END = rf"(?:(?<=api-key)|(?<=token)|(?<=secret)|(?<=password)|{_ABBREVIATED})"
SECRET_FLAG = re.compile(r"(?<![\w-])(?>--[\w-]+)" + _CREDENTIAL_END, re.IGNORECASE)
"""A command-line flag whose value is a credential: its name ends in ``api-key``, ``token``,
``secret`` or ``password`` (``--api-key``, ``--admin-api-key``; not ``--skip-tokenizer-init`` or
``--max-total-tokens``), or it is SGLang's abbreviation of one (``--api-ke``, ``--ap``). It starts
only where no dash or word character comes before it and is atomic, so a long run of dashes is
scanned once, not once per position."""

_SECRET_NAME_IN_TEXT = (
    r"(?<![\w-])(?>--[\w-]+)" + _CREDENTIAL_END + r"|\b(?>\w+)"
    r"(?:(?<=api_key)|(?<=secret)|(?<=password)|(?<=hf_token)|(?<=auth_token)|(?<=access_token)|(?<=api_token))\b"
)
_SECRET_IN_TEXT = re.compile(
    rf"(?P<name>{_SECRET_NAME_IN_TEXT})(?P<closing>['\"]?)(?P<sep>[ \t]*[=:][ \t]*|[ \t]+)"
    r"(?:(?P<quote>['\"])(?P<quoted>[^\n]{0,1024}?)(?P=quote)|(?P<value>[^\s'\",)}]+))"
    r"|(?P<bearer>\bBearer[ \t]+)(?P<bearer_value>[^\s'\",]+)",
    re.IGNORECASE,
)
"""A credential named in free text: ``--api-key KEY``, ``--api-key=KEY``, ``api_key='KEY'`` (a
quoted value up to its closing quote, whatever it holds), ``"api_key": "KEY"`` (a Python or JSON
dump of SGLang's arguments), ``hf_token=...``, ``Bearer KEY``. A bare ``token`` is not a name
(SGLang's ``#new-token: 6``, ``eos_token='<|im_end|>'`` keep their meaning)."""


def shown_command(cmd: Sequence[str]) -> list[str]:
    """``cmd`` as it may be logged: the value of every credential flag replaced by ``***``
    (``--api-key KEY`` and ``--api-key=KEY``); a flag is never taken for a value."""
    shown: list[str] = []
    hide_next = False
    for arg in cmd:
        if hide_next and not arg.startswith("--"):
            shown.append("***")
            hide_next = False
            continue
        hide_next = False
        flag, eq, _ = arg.partition("=")
        if SECRET_FLAG.fullmatch(flag):
            shown.append(f"{flag}=***" if eq else arg)
            hide_next = not eq
        else:
            shown.append(_hide_remembered(arg))
    return shown


MIN_REMEMBERED_CHARS = 8
"""Shorter secrets are not hidden by their value (it would hide ordinary words too)."""
MAX_REMEMBERED = 16
_remembered: set[str] = set()


def remember_secret(value: str | None) -> None:
    """Hide ``value`` (a configured token or API key) wherever :func:`redact_text` finds it, as
    it is, whatever it holds and however long: the patterns below find a credential by its name
    and stop at characters a value rarely holds (``,`` ``)``), or past 1024 characters."""
    if value and len(value) >= MIN_REMEMBERED_CHARS and len(_remembered) < MAX_REMEMBERED:
        _remembered.add(value)


def _hide_remembered(text: str) -> str:
    for secret in sorted(_remembered, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def redact_text(text: str) -> str:
    """``text`` (a log tail, an error message) with every credential's value as ``***``;
    ``None``/``False`` values are kept (no credential to hide)."""
    text = _hide_remembered(text)

    def hide(match: re.Match[str]) -> str:
        if match["bearer"] is not None:
            return f"{match['bearer']}***"
        value = match["quoted"] if match["quote"] is not None else match["value"]
        if value in ("None", "null", "False", "false", ""):
            return match[0]
        if match["sep"].strip() == "" and match["name"][:2] != "--":
            return match[0]  # "secret sauce" in prose: not a name and its value
        quote = match["quote"] or ""
        return f"{match['name']}{match['closing']}{match['sep']}{quote}***{quote}"

    return _SECRET_IN_TEXT.sub(hide, text)


HIDDEN_QUERY = "?..."
"""What a logged request target shows of its query string (:func:`shown_request_target`)."""


def shown_request_target(target: str) -> str:
    """A request's path and query (``/sync?token=SECRET``) as an access log may show it: the
    query string's text replaced by ``?...`` (a client may put a credential there, which the
    API refuses but the log line would keep), the path through :func:`redact_text`."""
    path, has_query, _ = target.partition("?")
    return redact_text(path) + (HIDDEN_QUERY if has_query else "")
