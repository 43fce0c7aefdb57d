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
