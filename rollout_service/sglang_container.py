"""``rollout-service sglang``: SGLang as a container's main process, its API key kept secret.

The Kubernetes and docker-compose manifests used to start ``python -m sglang.launch_server ...
--api-key KEY``: the key then stood in the container's command line (``ps`` on the node, the pod
spec) and in SGLang's first log line (``server_args={..., 'api_key':
'KEY', ...}``), which ``kubectl logs`` / ``docker compose logs`` and every log shipper keep.
This command starts SGLang with the key (``ROLLOUT_SGLANG_API_KEY``, or ``--api-key`` after ``--``)
in a private config file (:mod:`~rollout_service.sglang_key`), copies SGLang's output to its own
with every credential hidden (:func:`~rollout_service.redaction.redact_text`, the key's own value
too), forwards SIGTERM/SIGINT/SIGHUP to SGLang, and exits with SGLang's status.
Like ``serve`` it passes ``--log-level-http warning`` unless told another level (SGLang logs an
access line per request at its default: the sidecar's polls alone, ~43,000 a day).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import httpx

from .process_group import kill_me_with_parent
from .redaction import redact_text, remember_secret
from .sglang_key import key_off_command_line, remove_key_file, take_credentials, take_key, take_option
from .sglang_launcher import OWN_SGLANG_OPTIONS, quiet_http_log

log = logging.getLogger(__name__)

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SGLANG_DEFAULT_PORT = 30000
"""SGLang 0.5.23's ``--port`` when none is given."""
OUTPUT_DRAIN_S = 5.0
"""How long SGLang's output is still copied once its main process exited (its children may hold
the pipe open for good: then they are killed)."""


def sglang_command(python: str, args: Sequence[str], key: str | None) -> list[str]:
    """SGLang's command line: ``args`` with ``key`` as its ``--api-key`` (ValueError when ``args``
    give another one) and a quiet HTTP log unless ``args`` set its level."""
    rest, given = take_key(list(args))
    if given is not None and key is not None and given != key:
        raise ValueError(
            "SGLang's --api-key (after --) and ROLLOUT_SGLANG_API_KEY differ: give the key once,"
            " in ROLLOUT_SGLANG_API_KEY (the sidecar and the trainers are given the same)"
        )
    key = key if key is not None else given
    return [python, "-m", "sglang.launch_server", *quiet_http_log(rest), *rest, *(["--api-key", key] if key else [])]


def run_sglang(
    args: Sequence[str], key: str | None, *, python: str = sys.executable, out: IO[str] | None = None
) -> int:
    """Run SGLang with ``args`` until it exits; its exit status (128 + N when killed by signal N)."""
    out = out if out is not None else sys.stdout
    cmd, key_file = key_off_command_line(sglang_command(python, args, key))
    remember_secret(key if key is not None else take_key(list(args))[1])
    for value in take_credentials(list(args))[1].values():  # --admin-api-key, --ssl-keyfile-password
        remember_secret(value)
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group, which signals reach through `_forward`
            preexec_fn=kill_me_with_parent,  # this process killed (SIGKILL): SGLang is not left behind
        )
    except BaseException:
        remove_key_file(key_file)
        raise
    previous = {sig: signal.signal(sig, lambda signum, frame: _forward(proc, signum)) for sig in FORWARDED_SIGNALS}
    # (to SGLang's main process, which stops its scheduler and detokenizer itself: signalled too,
    # they die first and SGLang then kills itself, exit 137)
    # SGLang has read its --config file once it logs the arguments it parsed (or, at a --log-level
    # that hides that line, once it answers /health): the key file goes then, so that a SIGKILL of
    # this command (nothing then runs its cleanup) leaves no key behind.
    if key_file is not None:
        threading.Thread(
            target=_remove_once_serving, args=(_health_url(args), proc, key_file), daemon=True, name="sglang-key"
        ).start()
    copier = threading.Thread(
        target=_copy_redacted,
        args=(proc.stdout, out, lambda: remove_key_file(key_file)),
        daemon=True,
        name="sglang-output",
    )
    copier.start()
    try:
        while True:
            try:
                code = proc.wait()
                break
            except InterruptedError:  # pragma: no cover (PEP 475 retries)
                continue
        copier.join(OUTPUT_DRAIN_S)
        _kill_group(proc)  # what SGLang left running (it holds its output open, or would be orphaned)
        copier.join(OUTPUT_DRAIN_S)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        remove_key_file(key_file)
    return 128 - code if code < 0 else code


def _forward(proc: subprocess.Popen[bytes], signum: int) -> None:
    """Send ``signum`` to SGLang's main process (once it has exited: nothing)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL what is left of SGLang's process group, right after its leader was reaped."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


KEY_POLL_S = 2.0
"""How often SGLang's /health is asked until it answers (then the key file goes)."""


def _health_url(args: Sequence[str]) -> str:
    """SGLang's /health as ``args`` set its host and port (SGLang's defaults otherwise)."""
    _, host = take_option(list(args), OWN_SGLANG_OPTIONS["host"])
    _, port = take_option(list(args), OWN_SGLANG_OPTIONS["port"])
    if not host or host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port or SGLANG_DEFAULT_PORT}/health"


def _remove_once_serving(url: str, proc: subprocess.Popen[bytes], key_file: Path) -> None:
    """Remove ``key_file`` once SGLang answers ``url`` (it read its arguments long before)."""
    while proc.poll() is None and key_file.exists():
        try:
            if httpx.get(url, timeout=KEY_POLL_S).status_code == 200:
                remove_key_file(key_file)
                return
        except httpx.HTTPError:
            pass
        time.sleep(KEY_POLL_S)


ARGS_READ_MARK = "server_args="
"""What SGLang's log line of its parsed arguments holds (SGLang 0.5.23 logs it as it starts)."""


def _copy_redacted(source: IO[bytes] | None, out: IO[str], args_read: Callable[[], None]) -> None:
    """Copy SGLang's output line by line, every credential hidden; call ``args_read`` when SGLang
    logs the arguments it parsed. Once ``out`` cannot be written (closed, a broken pipe, a locale
    that cannot encode a line) the output is still read to its end and dropped: SGLang writing into
    a full pipe would block, in its SIGTERM handler too."""
    if source is None:
        return
    writing = True
    for raw in iter(source.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        if ARGS_READ_MARK in line:
            args_read()
        if not writing:
            continue
        try:
            out.write(redact_text(line))
            out.flush()
        except (OSError, ValueError) as exc:  # (UnicodeEncodeError is a ValueError)
            writing = False
            log.warning("SGLang's output can no longer be copied (%s): it is read and dropped from now on", exc)
