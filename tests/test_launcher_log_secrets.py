"""SGLang's command line is logged when it starts, and may carry a credential (``--api-key``,
given after ``--`` to ``serve`` and by the demo): the log shows ``***`` in its place."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rollout_service import sglang_launcher
from rollout_service.http_urls import check_http_url
from rollout_service.redaction import redact_text
from rollout_service.sglang_launcher import SGLangServer, shown_command
from rollout_service.sidecar.settings import SidecarSettings


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


def test_redaction_keeps_the_meaning_of_ordinary_text_and_hides_whole_quoted_keys() -> None:
    from rollout_service.redaction import redact_text

    kept = [
        "Decode batch. #running-req: 1, #new-token: 6, #cached-token: 0, #token: 38",
        "eos_token='<|im_end|>' is not in the vocabulary",
        "Unknown special token: <|fim|>; invalid token: expected ','",
        "the secret sauce, api_key=None, admin_api_key=None",
    ]
    for text in kept:
        assert redact_text(text) == text
    hidden = redact_text(
        "api_key='k,ey)x' api_key=\"ab'cd\" --api-key 'my key' --api-key=abc/def+gh== api_key: sk-abc/def+g="
        " hf_token='hf_x' Authorization: Bearer BEARERKEY"
    )
    for secret in ("k,ey", "ey)x", "ab'cd", "'cd", "my key", "abc/def", "sk-abc", "hf_x", "BEARERKEY"):
        assert secret not in hidden, (secret, hidden)


def test_redaction_of_long_runs_of_flag_like_characters_ends_instead_of_hanging() -> None:
    """A log line of 256 KiB of dashes (a logged prompt can be anything) took minutes with a
    backtracking flag pattern; the error paths that quote log tails must not hang on it.

    This checks that redaction ends (a generous 30 s deadline, far below those minutes), not how
    fast: Python's ``re`` counts no steps to compare, and speed belongs to benchmarks."""
    import threading

    from rollout_service.redaction import redact_text

    texts = ["-" * (256 << 10), "a--" * (85 << 10), "a_" * (128 << 10), "api_key='" * (28 << 10), "-- " * (85 << 10)]
    done: list[int] = []
    worker = threading.Thread(target=lambda: done.extend(len(redact_text(t)) for t in texts), daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive() and len(done) == len(texts), "redact_text did not finish within 30 s"


def test_a_log_end_cut_inside_a_line_never_shows_the_rest_of_a_key(tmp_path: Path) -> None:
    """The window of a long log's end may start inside SGLang's ``server_args`` line, after the
    ``api_key=`` that names the key: that partial line is dropped."""
    from rollout_service.process_group import log_end

    log = tmp_path / "sglang.log"
    line = "server_args=ServerArgs(api_key='SECRETKEY123456', port=1)\n"
    log.write_text("x" * 1000 + "\n" + line + "later line\n")
    size = log.stat().st_size
    for cut in range(len("later line\n") + 1, len(line) + len("later line\n")):
        text = log_end(log, max_bytes=cut)
        assert "KEY123456" not in text and "SECRET" not in text, (cut, text)
    assert log_end(log, max_bytes=size).startswith("x")  # the whole file: nothing dropped


def test_a_credential_in_a_command_line_error_is_hidden(capsys: pytest.CaptureFixture[str]) -> None:
    """SGLang's ``--api-key`` given to ``serve`` without ``--`` is an unknown argument: the error
    argparse prints (into the container's log) shows ``***``."""
    from rollout_service.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", "m", "--checkpoint-path", "/nonexistent", "--api-key", "SECRETX"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "unrecognized arguments: --api-key ***" in err and "SECRETX" not in err


@pytest.mark.parametrize("flag", ["--api-ke", "--ap", "--admin-api-k", "--ad", "--ssl-keyfile-passw"])
def test_sglangs_abbreviations_of_a_credential_flag_are_hidden_in_the_logged_command_and_in_errors(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """SGLang's parser takes ``--api-ke KEY`` for ``--api-key KEY``: its value is a credential too."""
    assert shown_command(["sglang", flag, "KEY-VALUE-1", f"{flag}=KEY-VALUE-2", "--port", "1"]) == [
        "sglang",
        flag,
        "***",
        f"{flag}=***",
        "--port",
        "1",
    ]
    from rollout_service.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--model", "m", "--checkpoint-path", "/nonexistent", flag, "KEY-VALUE-3"])
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {flag} ***" in err and "KEY-VALUE" not in err
    # Flags that only look alike keep their values.
    assert shown_command(["--apple", "v", "--snap", "w", "--a", "x"]) == ["--apple", "v", "--snap", "w", "--a", "x"]


def test_the_credential_options_listed_are_sglangs_with_the_abbreviations_its_parser_takes() -> None:
    """The table the redaction reads (`SGLANG_CREDENTIAL_OPTIONS`) against SGLang's own parser:
    every option it has whose value is a credential, and the shortest prefix it takes for each."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from rollout_service.redaction import SECRET_FLAG, SGLANG_CREDENTIAL_OPTIONS

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    options = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
    credentials = {o for o in options if o.endswith(("api-key", "password", "secret", "auth-token"))}
    assert credentials == set(SGLANG_CREDENTIAL_OPTIONS)
    for option, shortest in SGLANG_CREDENTIAL_OPTIONS.items():
        assert [o for o in options if o.startswith(shortest)] == [option], option
        assert len([o for o in options if o.startswith(shortest[:-1])]) > 1, option  # the shortest
        assert SECRET_FLAG.fullmatch(shortest) and not SECRET_FLAG.fullmatch(shortest[:-1])


def test_a_process_name_that_is_not_utf8_does_not_stop_the_group_walk() -> None:
    """Linux cuts a process name at 15 bytes, mid-character too: reading /proc must not raise."""
    import os
    import subprocess
    import sys
    import time

    from rollout_service.process_group import descendant_groups

    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, time; open('/proc/self/comm', 'wb').write(b'\\xe6\\x8e\\xa8x\\xff');"
            " os.setpgid(0, 0); time.sleep(30)",
        ]
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/{child.pid}/comm", "rb") as comm:
                if comm.read().startswith(b"\xe6"):
                    break
        assert child.pid in descendant_groups(os.getpid())
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize(
    "key",
    ["k" * 1500, "ab,cd)ef'gh\"ij", "x)" * 40],
    ids=["longer-than-a-quoted-value", "punctuation", "closing-parens"],
)
def test_a_configured_key_is_hidden_whatever_it_holds(tmp_path: Path, key: str) -> None:
    """A key the settings accept (printable ASCII, up to 4096 characters) is hidden by its value,
    where the patterns that find a credential by its name stop early: at 1024 characters of a
    quoted value, or at a ``,`` ``)`` or quote of an unquoted one."""
    SidecarSettings(checkpoint_path=tmp_path, sglang_url="http://127.0.0.1:1", replica_id="r", sglang_api_key=key)
    lines = [
        f"server_args=ServerArgs(model_path='m', api_key='{key}', port=1)",
        f"server_args=ServerArgs(model_path='m', api_key=\"{key}\")",
        f"Authorization: Bearer {key}",
        f"ROLLOUT_SGLANG_API_KEY={key} rollout-service serve",
    ]
    for line in lines:
        shown = redact_text(line)
        half = len(key) // 2
        assert key[:half] not in shown and key[half:] not in shown, shown[:200]  # nor any part of it


def test_a_password_in_a_url_is_not_repeated_by_the_error_that_refuses_the_url() -> None:
    for url in ("http://admin:hunter2@sglang:99999", "ftp://admin:hunter2@sglang", "http://admin:hunter2@"):
        with pytest.raises(ValueError) as refused:
            check_http_url(url, "--sglang-url")
        assert "hunter2" not in str(refused.value) and "***@" in str(refused.value), str(refused.value)


@pytest.mark.parametrize("url", ["http://sglang:30000/?api_key=hunter2", "http://sglang:30000#hunter2"])
def test_a_url_with_a_query_or_fragment_is_refused_without_repeating_it(url: str) -> None:
    """A base URL has no query: one would be sent with every request and shown in /status."""
    with pytest.raises(ValueError, match="query or fragment") as refused:
        check_http_url(url, "--sglang-url")
    assert "hunter2" not in str(refused.value)


@pytest.mark.parametrize(
    "url",
    [
        "http://sglang:99999/?api_key=hunter2",  # a port out of range
        "http://[::1/?api_key=hunter2",  # not parsable
        "ftp://sglang:1/?api_key=hunter2",  # another scheme
        "http://:1/#hunter2",  # no host
        "http://sglang:99999#hunter2?x",
    ],
)
def test_no_error_refusing_a_url_repeats_its_query_or_fragment(url: str) -> None:
    """Whatever else is wrong with the URL, the error that names it shows ``?...`` for its query."""
    with pytest.raises(ValueError) as refused:
        check_http_url(url, "--sglang-url")
    assert "hunter2" not in str(refused.value) and "?..." in str(refused.value), str(refused.value)


def test_a_url_scheme_is_accepted_in_any_case_and_given_back_in_lower_case() -> None:
    assert check_http_url("HTTP://Sglang:30000/", "--sglang-url") == "http://Sglang:30000"
    assert check_http_url("Https://h:1/v1", "--sglang-url") == "https://h:1/v1"
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        check_http_url("httpx://h:1", "--sglang-url")
