"""SGLang's API key stays off command lines and out of the logs this project writes or copies.

A review found the key on SGLang's command line (``ps``, ``/proc/PID/cmdline``: every user of the
machine; ``docker inspect``), in SGLang's first log line (``server_args={... 'api_key': 'KEY' ...}``), which
``kubectl logs`` keeps when the manifests start SGLang directly, and in ``serve --sglang-log``
files made world-readable. Now ``serve`` (:class:`SGLangServer`) and the containers' ``rollout-service
sglang`` hand the key to SGLang in a 0600 ``--config`` file, ``rollout-service sglang`` copies
SGLang's output with credentials hidden, and SGLang's log files are made 0600. Real SGLang here.
"""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from conftest import SERVER_EXTRA_ARGS, SERVER_HEALTH_TIMEOUT_S
from helpers import free_port
from rollout_service.sglang_key import key_off_command_line, remove_key_file, take_key
from rollout_service.sglang_launcher import SGLangServer
from rollout_service.sidecar.sglang_client import ServerView, SGLangClient
from sidecar_helpers import CLIProcess

KEY = "k3y-" + "s3cr3t" * 6


@pytest.mark.parametrize(
    "args",
    [["--api-key", KEY], [f"--api-key={KEY}"], ["--api-ke", KEY], ["--api-key", "old", "--api-key", KEY]],
)
def test_the_key_is_taken_from_every_spelling_sglang_takes(args: list[str]) -> None:
    rest, key = take_key(["--port", "1", *args, "--dtype", "float32"])
    assert key == KEY and rest == ["--port", "1", "--dtype", "float32"]


def test_the_key_moves_into_a_file_only_its_user_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    cmd, path = key_off_command_line(["python", "-m", "sglang.launch_server", "--api-key", KEY, "--port", "1"])
    assert path is not None and KEY not in " ".join(cmd) and cmd[-2:] == ["--config", str(path)]
    assert path.read_text() == f'api-key: "{KEY}"\n'
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    # A --config of the user's: SGLang takes one only, so the key stays (and the log says so).
    given = ["python", "-m", "sglang.launch_server", "--config", "mine.yaml", "--api-key", KEY]
    assert key_off_command_line(given) == (given, None)


@pytest.mark.parametrize("key", ["a: b #c", "k\u00e9y-\U0001f600-" + "x" * 40, "true", 'q"uo\\te'])
def test_sglang_reads_back_exactly_the_key_written(tmp_path: Path, key: str) -> None:
    """Through SGLang 0.5.23's own argument parsing (its --config merger, then argparse)."""
    from sglang.srt.server_args import prepare_server_args

    cmd, path = key_off_command_line(["--model-path", "m", "--api-key", key])
    try:
        assert prepare_server_args(cmd).api_key == key
    finally:
        remove_key_file(path)


def test_a_key_starting_with_a_dash_stays_on_the_command_line(caplog: pytest.LogCaptureFixture) -> None:
    """SGLang's config merger would hand it on as `--api-key -...`, which its parser refuses."""
    given = ["python", "-m", "sglang.launch_server", "--api-key=-dash-key-" + "x" * 20]
    assert key_off_command_line(given) == (given, None)
    assert "starting with '-'" in caplog.text


def test_an_existing_log_file_others_could_read_is_made_its_users_alone(tmp_path: Path) -> None:
    """A log made before (an older release, by hand) kept its mode, and SGLang writes its key there."""
    from rollout_service.process_group import open_log

    log = tmp_path / "sglang.log"
    log.write_text("old\n")
    log.chmod(0o644)
    os.close(open_log(log, "--sglang-log"))
    assert stat.S_IMODE(log.stat().st_mode) == 0o600 and log.read_text() == "old\n"


def _command_lines(root_pid: int) -> list[str]:
    procs = [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]
    lines = []
    for proc in procs:
        try:
            lines.append(" ".join(proc.cmdline()))
        except psutil.Error:
            pass
    return lines


def _sglang_pids(root_pid: int) -> list[int]:
    return [p.pid for p in [psutil.Process(root_pid), *psutil.Process(root_pid).children(recursive=True)]]


def _answers_only_with_the_key(url: str) -> None:
    assert httpx.get(f"{url}/model_info", timeout=30).status_code == 401
    assert httpx.get(f"{url}/model_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200
    # The sidecar's view of this SGLang with a wrong or no key names the key, not silence.
    for key in ("wrong", None):
        view = asyncio.run(_sidecar_view(url, key))
        assert not view.healthy and view.refusal is not None and "API key" in view.refusal, view
    assert asyncio.run(_sidecar_view(url, KEY)).healthy


async def _sidecar_view(url: str, key: str | None) -> ServerView:
    client = SGLangClient(url, api_key=key, timeout_s=30)
    try:
        return await client.view(deep=True)
    finally:
        await client.aclose()


@pytest.mark.sglang
def test_serve_starts_sglang_with_its_key_in_a_private_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "sglang.log"
    server = SGLangServer(
        tiny_model_dir,
        device="cpu",
        python=sys.executable,
        log_path=log,
        extra_args=(*SERVER_EXTRA_ARGS, "--api-key", KEY),
        die_with_parent=True,
    )
    server.start()
    try:
        server.wait_healthy(SERVER_HEALTH_TIMEOUT_S)
        assert server.pid is not None
        lines = _command_lines(server.pid)
        assert lines and not any(KEY in line for line in lines), lines
        _answers_only_with_the_key(server.url)
        assert stat.S_IMODE(log.stat().st_mode) == 0o600  # SGLang logs its arguments, key included
        config = next(line for line in lines if "--config" in line).split("--config ")[1].split(" ")[0]
        # read when SGLang parsed its arguments: gone once it is healthy (a SIGKILLed serve leaves nothing)
        assert not Path(config).exists() and not Path(config).parent.exists()
    finally:
        server.stop()


@pytest.mark.sglang
def test_the_sglang_command_keeps_the_key_off_its_command_line_and_out_of_its_output(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    # The flags and environment `serve` gives SGLang on the CPU (the CPU image sets them for the
    # container): the arguments after `--` are SGLang's own.
    like_serve = SGLangServer(
        tiny_model_dir, device="cpu", port=port, python=sys.executable, extra_args=SERVER_EXTRA_ARGS
    )
    args = like_serve.command()[3:]
    env = {**like_serve.environment(), "ROLLOUT_SGLANG_API_KEY": KEY, "TMPDIR": str(tmp_path)}
    like_serve.stop()  # (its temporary log only: it never started)
    output = tmp_path / "container.log"
    proc = CLIProcess(["sglang", "--", *args], output, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_HEALTH_TIMEOUT_S
        while True:
            assert proc.proc.poll() is None, proc.log_tail()
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, proc.log_tail()
            time.sleep(1)
        lines = _command_lines(proc.proc.pid)
        assert len(lines) >= 2 and not any(KEY in line for line in lines), lines
        assert any("--config" in line and "--log-level-http warning" in line for line in lines), lines
        _answers_only_with_the_key(url)
        # Gone once SGLang has read it (a SIGKILL of the command would leave it behind otherwise).
        assert not list(tmp_path.glob("sglang-key-*")), list(tmp_path.iterdir())
        pids = _sglang_pids(proc.proc.pid)
        proc.group.process.send_signal(signal.SIGTERM)  # to the command alone (a container's PID 1)
        assert proc.proc.wait(60) == 0, proc.log_tail()
    finally:
        proc.kill()
    text = output.read_text()
    assert "server_args=" in text and "'api_key': '***'" in text, text[-3000:]  # SGLang logs it; hidden
    assert KEY not in text
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in pids)


def test_every_credential_sglang_takes_moves_into_the_file_and_sglang_reads_them_back(tmp_path: Path) -> None:
    """``--admin-api-key`` and ``--ssl-keyfile-password`` stood on SGLang's command line (``ps``)."""
    from sglang.srt.server_args import prepare_server_args

    given = [
        "--model-path",
        "m",
        "--api-key",
        KEY,
        "--admin-ap",  # an abbreviation SGLang's parser takes
        "admin-" + KEY,
        "--ssl-keyfile-password=pw-" + KEY,
    ]
    cmd, path = key_off_command_line(given)
    try:
        assert path is not None and not any(KEY in arg for arg in cmd), cmd
        args = prepare_server_args(cmd)
        assert (args.api_key, args.admin_api_key, args.ssl_keyfile_password) == (KEY, "admin-" + KEY, "pw-" + KEY)
    finally:
        remove_key_file(path)
    # One starting with '-' stays (in its '=' form, the one argparse takes); the others move.
    cmd, path = key_off_command_line(["--model-path", "m", "--admin-api-key=-dash", "--api-key", KEY])
    try:
        assert "--admin-api-key=-dash" in cmd and KEY not in " ".join(cmd)
        args = prepare_server_args(cmd)
        assert (args.api_key, args.admin_api_key) == (KEY, "-dash")
    finally:
        remove_key_file(path)


@pytest.mark.parametrize(
    ("args", "url"),
    [
        ([], "http://127.0.0.1:30000/health"),
        (["--host", "0.0.0.0", "--port", "31000"], "http://127.0.0.1:31000/health"),
        (["--ho=10.1.2.3", "--po=1234"], "http://10.1.2.3:1234/health"),
        (["--host", "::1"], "http://[::1]:30000/health"),
    ],
)
def test_the_command_asks_sglang_where_its_arguments_put_it(args: list[str], url: str) -> None:
    from rollout_service.sglang_container import _health_url

    assert _health_url(["--model-path", "m", *args]) == url


def test_the_key_file_goes_once_sglang_answers_when_its_log_hides_its_arguments(tmp_path: Path) -> None:
    """At ``--log-level warning`` SGLang never logs its parsed arguments: the key file stayed until
    SGLang exited (a SIGKILL of the command then left it). It goes once /health answers too. The
    server here is `fake_sglang.CannedServer` answering /health; a real SGLang's start is in
    `test_the_sglang_command_keeps_the_key_off_its_command_line_and_out_of_its_output`."""
    import subprocess

    from fake_sglang import CannedServer
    from rollout_service.sglang_container import _remove_once_serving
    from rollout_service.sglang_key import write_key_file

    key_file = write_key_file(KEY)
    server = CannedServer(lambda path, body, count: None)  # /health: 200
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _remove_once_serving(f"{server.url}/health", running, key_file)
        assert not key_file.exists() and not key_file.parent.exists()
    finally:
        running.kill()
        running.wait()
        server.stop()
        remove_key_file(key_file)


def test_sglangs_output_is_still_drained_when_it_can_no_longer_be_copied() -> None:
    """The copier stopped at the first write that failed (a closed stdout, an encoding error):
    SGLang's pipe then filled and SGLang blocked at its next log line, in its SIGTERM handler too."""
    import subprocess

    from rollout_service.sglang_container import _copy_redacted

    class Closed:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            pass

    talker = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfor i in range(2000): print('x' * 500, flush=True)"],
        stdout=subprocess.PIPE,
    )
    try:
        _copy_redacted(talker.stdout, Closed(), lambda: None)  # type: ignore[arg-type]
        assert talker.wait(30) == 0  # ~1 MB through a 64 KiB pipe: it was read to its end
    finally:
        talker.kill()
        talker.wait()
