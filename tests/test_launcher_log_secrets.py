"""SGLang's command line is logged when it starts, and may carry a credential (``--api-key``,
given after ``--`` to ``serve`` and by the demo): the log shows ``***`` in its place."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rollout_service import sglang_launcher
from rollout_service.sglang_launcher import SGLangServer, shown_command


class NoProcess:
    """Stands in for the process group: nothing is started."""

    def __init__(self, *args: object, **kw: object) -> None:
        pass

    def start(self) -> None:
        pass


def test_the_logged_command_hides_the_api_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(sglang_launcher, "ProcessGroup", NoProcess)
    server = SGLangServer(
        tmp_path,
        device="cpu",
        log_path=tmp_path / "s.log",
        extra_args=["--api-key", "SECRET-1", "--admin-api-key=SECRET-2"],
    )
    assert "SECRET-1" in server.command()  # SGLang itself gets it
    with caplog.at_level(logging.INFO, logger=sglang_launcher.__name__):
        server.start()
    assert "starting SGLang" in caplog.text
    assert "SECRET" not in caplog.text, caplog.text
    assert "--api-key *** --admin-api-key=***" in caplog.text


def test_only_credential_flags_are_hidden() -> None:
    cmd = ["python", "-m", "sglang", "--port", "30000", "--api-key", "K", "--model-path", "m", "--api-key"]
    assert shown_command(cmd) == [
        "python",
        "-m",
        "sglang",
        "--port",
        "30000",
        "--api-key",
        "***",
        "--model-path",
        "m",
        "--api-key",
    ]


def test_a_boolean_flag_named_like_a_credential_never_unmasks_the_next_one() -> None:
    """``--skip-tokenizer-init`` (a flag without a value) before ``--api-key KEY``: the key is
    still hidden, and flags that only contain "token" keep their values."""
    cmd = ["--skip-tokenizer-init", "--api-key", "SEKRET", "--max-total-tokens", "4096", "--tokenizer-path", "t"]
    assert shown_command(cmd) == [
        "--skip-tokenizer-init",
        "--api-key",
        "***",
        "--max-total-tokens",
        "4096",
        "--tokenizer-path",
        "t",
    ]
    assert shown_command(["--token", "--api-key", "K"]) == ["--token", "--api-key", "***"]


def test_a_log_tail_hides_the_key_sglang_logs_itself(tmp_path: Path) -> None:
    """SGLang logs its own arguments at start (``server_args=ServerArgs(... api_key='...')``);
    the tails quoted in errors, /status and /readyz show ``***``."""
    from rollout_service.process_group import log_tail

    log = tmp_path / "sglang.log"
    log.write_text(
        "INFO server_args=ServerArgs(model_path='m', api_key='SEKRET', admin_api_key=None, max_total_tokens=4096)\n"
        'INFO {"api_key": "SEKRET2"} launched with --api-key SEKRET3\n'
        "RuntimeError: boom\n"
    )
    tail = log_tail(log)
    assert "SEKRET" not in tail and "api_key='***'" in tail and "max_total_tokens=4096" in tail
    assert tail.endswith("RuntimeError: boom\n")


def test_a_log_that_is_a_pipe_is_not_read_and_never_blocks(tmp_path: Path) -> None:
    """``--sglang-log /dev/stdout`` (a pipe under docker) or a FIFO: reading its tail must not
    block the wait for SGLang or its give-up path."""
    import os
    import threading

    from rollout_service.process_group import log_tail

    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    result: list[str] = []
    reader = threading.Thread(target=lambda: result.append(log_tail(fifo)), daemon=True)
    reader.start()
    reader.join(5)
    assert not reader.is_alive(), "log_tail blocked on a FIFO"
    assert result == [""]
