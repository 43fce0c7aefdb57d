"""Argument and launch checks of ``serve`` and the other commands, found in a review of the CLI.

Each test names what went wrong before: ``serve --sglang-log FIFO`` hung for good, deaf to SIGTERM;
arguments after ``--`` could move SGLang to another port or model than the one serve watched; an
empty ``--checkpoint-path`` watched the current directory; ``scripts/run.sh`` ran commands in the
repository instead of the caller's directory; ``localhost`` and ``127.0.0.1`` on one port passed the
clash check; a signal during serve's CUDA probe orphaned the probe and exited 143 or 130; the demo
took ``--num-generations 0``; nothing warned of servers open to the network without credentials;
a refused ``serve`` left its checkpoint root and SGLang's temporary log behind; two help and error
texts said the wrong thing; and ``ProcessGroup.stop()`` signalled a process group by a number that
may have been given to a stranger since. None of them starts a real SGLang server.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from helpers import free_port
from rollout_service import cli
from rollout_service.cli import _same_addresses, build_parser, main
from rollout_service.process_group import ProcessGroup
from rollout_service.serve import RestartPolicy, Supervisor, run_serve
from rollout_service.sglang_launcher import SGLangServer, SGLangStartError, flag_value
from rollout_service.sidecar.settings import SidecarSettings

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def no_rollout_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``ROLLOUT_*`` variable of the machine running the tests changes a command line here."""
    for name in list(os.environ):
        if name.startswith("ROLLOUT_"):
            monkeypatch.delenv(name)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> dict:
    """``serve`` with `run_serve` replaced by a recorder: what it would have started, nothing started."""
    seen: dict = {}

    def recorder(server, settings, policy, listeners):
        for sock in listeners:
            sock.close()
        seen["command"], seen["settings"], seen["server"] = server.command(), settings, server
        return 0

    monkeypatch.setattr(cli, "run_serve", recorder)
    return seen


def _serve(capsys, tmp_path: Path, *argv: str, root: Path | None = None) -> tuple[int, str]:
    root = root or tmp_path / "root"
    rc = main(["serve", "--model", str(tmp_path), "--checkpoint-path", str(root), "--device", "cpu", *argv])
    return rc, capsys.readouterr().err


def _script(path: Path, code: str) -> Path:
    """An executable Python script (a stand-in for SGLang's interpreter)."""
    path.write_text(f"#!{sys.executable}\n{code}")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ------------------------------------------------------------------ 1. --sglang-log that blocks


def test_serve_with_a_fifo_no_one_reads_as_its_log_fails_at_once_naming_the_flag(tmp_path: Path) -> None:
    """Before, the open of the FIFO waited for a reader forever and SIGTERM did not end it."""
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    argv = ["serve", "--model", str(tmp_path), "--checkpoint-path", str(tmp_path / "root"), "--device", "cpu"]
    argv += ["--port", str(free_port()), "--sidecar-port", str(free_port()), "--stage-dir", str(tmp_path / "stage")]
    done = subprocess.run(
        [sys.executable, "-m", "rollout_service.cli", *argv, "--sglang-log", str(fifo)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=REPO,
    )
    assert done.returncode == 2, done.stderr
    assert f"error: --sglang-log {fifo} is a FIFO that no process reads" in done.stderr


def test_a_process_group_never_blocks_opening_its_log_and_writes_to_a_fifo_that_is_read(tmp_path: Path) -> None:
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    group = ProcessGroup([sys.executable, "-c", "print('to the reader')"], fifo, name="stand-in")
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            group.start()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    opener = threading.Thread(target=start, daemon=True)
    opener.start()
    opener.join(10)
    assert outcome, "opening a FIFO nobody reads blocked"
    assert isinstance(outcome[0], ValueError) and group.process is None
    assert f"the log of stand-in {fifo} is a FIFO that no process reads" in str(outcome[0])
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # now something reads it: it works
    try:
        group.start()
        assert group.process is not None and group.process.wait(30) == 0
        assert os.read(reader, 100) == b"to the reader\n"
    finally:
        os.close(reader)
        group.stop(5)


@pytest.mark.parametrize("value", ["", "  ", "DIR"])
def test_sglang_log_that_is_empty_or_a_directory_is_refused_naming_the_flag(
    capsys, tmp_path: Path, recorded: dict, value: str
) -> None:
    """Before: ``[Errno 21] Is a directory: '.'`` (an empty value was the current directory)."""
    value = str(tmp_path) if value == "DIR" else value
    try:
        rc, err = _serve(capsys, tmp_path, "--sglang-log", value)
    except SystemExit as exc:  # argparse's refusal of the text
        rc, err = int(exc.code or 0), capsys.readouterr().err
    assert rc == 2 and not recorded, err
    assert "--sglang-log" in err and ("is a directory" in err or "must name a file" in err), err


# ---------------------------------------------------------- 2. serve's own flags after `--`


@pytest.mark.parametrize(
    "passthrough, flag",
    [
        (["--port", "1234"], "--port"),
        (["--port=1234"], "--port"),
        (["--po", "1234"], "--port"),
        (["--host", "0.0.0.0"], "--sglang-host"),
        (["--ho=0.0.0.0"], "--sglang-host"),
        (["--model-path", "/other"], "--model"),
        (["--model", "/other"], "--model"),
        (["--model-pa=/other"], "--model"),
    ],
)
def test_serve_refuses_sglang_flags_after_dashes_that_it_sets_itself(
    capsys, tmp_path: Path, recorded: dict, passthrough: list[str], flag: str
) -> None:
    """SGLang keeps the last of a repeated flag: serve would have waited on another port."""
    rc, err = _serve(capsys, tmp_path, "--", *passthrough)
    assert rc == 2 and not recorded, err
    assert err.startswith("error: ") and f"give it as serve's {flag} instead" in err, err


@pytest.mark.parametrize("passthrough", [["--model-impl", "sglang"], ["--hicache-size", "1"], ["--pp-size", "1"]])
def test_other_sglang_flags_after_dashes_still_pass(capsys, tmp_path: Path, recorded: dict, passthrough) -> None:
    rc, err = _serve(capsys, tmp_path, "--", *passthrough)
    assert rc == 0, err
    assert recorded["command"][-len(passthrough) :] == passthrough


@pytest.mark.parametrize("passthrough", [["--api-key", "a", "--api-key", "b"], ["--api-key=a", "--api-ke", "a"]])
def test_serve_refuses_a_repeated_api_key_after_dashes(capsys, tmp_path: Path, recorded: dict, passthrough) -> None:
    """The sidecar took the first key, SGLang the last: every weight update refused with 401."""
    rc, err = _serve(capsys, tmp_path, "--", *passthrough)
    assert rc == 2 and not recorded and "given 2 times" in err and "--sglang-api-key" in err, err


def test_an_abbreviated_api_key_after_dashes_is_the_sidecars_too(capsys, tmp_path: Path, recorded: dict) -> None:
    rc, err = _serve(capsys, tmp_path, "--", "--api-ke", "abbreviated")
    assert rc == 0, err
    assert recorded["settings"].sglang_api_key == "abbreviated"


def test_flag_value_is_the_last_value_as_sglang_takes_it() -> None:
    assert flag_value(["--tp-size", "2", "--tp-size=4"], "--tp-size") == "4"
    assert flag_value(["--tp", "2"], "--tp-size", "--tp") == "2"
    assert flag_value(["--dtype"], "--dtype") is None


# ----------------------------------------------------------- 3. an empty required setting


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["sidecar", "--sglang-url", "http://127.0.0.1:1", "--checkpoint-path", ""], "--checkpoint-path"),
        (["sidecar", "--sglang-url", "http://127.0.0.1:1", "--checkpoint-path", "  "], "--checkpoint-path"),
        (["serve", "--checkpoint-path", "/tmp/r", "--model", ""], "--model"),
        (["serve", "--model", "m", "--checkpoint-path", ""], "--checkpoint-path"),
    ],
)
def test_an_empty_value_of_a_required_setting_is_refused_naming_the_flag(capsys, argv: list[str], flag: str) -> None:
    """Before: ``Path("")`` is ".", so the sidecar watched the current directory."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert f"argument {flag}: must not be empty" in capsys.readouterr().err


def test_a_blank_variable_of_a_required_setting_is_refused_naming_it(capsys, monkeypatch) -> None:
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_PATH", "   ")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sidecar", "--sglang-url", "http://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert "ROLLOUT_CHECKPOINT_PATH='   ' is not valid for --checkpoint-path: must not be empty" in err


# ----------------------------------------------------------- 4. run.sh in the caller's directory


def test_run_sh_runs_the_command_in_the_callers_directory(tmp_path: Path) -> None:
    """Before, it changed to the repository first: relative paths named files there."""
    venv = os.environ.get("VIRTUAL_ENV", "")
    key = subprocess.run(
        ["bash", "-c", '(cat "$1"; python3 -c "import sys; print(sys.version)"; echo v2) | sha256sum | cut -c1-16', "-"]
        + [str(REPO / "requirements" / "cpu.lock")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not venv or Path(venv).name != f"venv-{key}" or not (Path(venv) / ".complete").exists():
        raise AssertionError(
            "run the tests through scripts/run.sh (the README's test command): outside the environment it"
            " builds, this test would build a new one"
        )
    (tmp_path / "where.py").write_text("import os; print(os.getcwd())\n")
    done = subprocess.run(
        [str(REPO / "scripts" / "run.sh"), "python", "where.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "ROLLOUT_CACHE_DIR": str(Path(venv).parent)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path)


# ------------------------------------------------------------ 5. one port, one address by two names


def test_serve_refuses_one_port_for_two_names_of_one_address(capsys, tmp_path: Path, recorded: dict) -> None:
    port = str(free_port())
    flags = ["--sglang-host", "localhost", "--host", "127.0.0.1", "--port", port, "--sidecar-port", port]
    rc, err = _serve(capsys, tmp_path, *flags)
    assert rc == 2 and not recorded and f"--port and --sidecar-port are both {port}" in err, err
    assert _same_addresses("localhost", "127.0.0.1") and _same_addresses("127.0.0.1", "localhost")
    assert not _same_addresses("::", "0.0.0.0") and _same_addresses("0.0.0.0", "localhost")


# ------------------------------------------------------------- 6. signals during serve's set-up

SLOW_PROBE = """
import os, sys, time
with open(os.environ["PROBE_PIDS"], "a") as f:
    f.write(f"{os.getpid()}\\n")
time.sleep(float(os.environ.get("PROBE_SLEEP", "600")))
"""

SERVE_WITH = """
import functools, sys
import rollout_service.cli as cli
cli.SGLangServer = functools.partial(cli.SGLangServer, python=sys.argv[1])
sys.exit(cli.main(sys.argv[2:]))
"""


def _pids(path: Path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_cuda_probe_of_serve_exits_0_and_ends_the_probe(tmp_path: Path, sig) -> None:
    """``--device auto`` asks torch (up to 300 s) before serve's handlers were installed: SIGTERM
    killed serve (143) and orphaned the probe; Ctrl-C exited 130."""
    probe, pids = _script(tmp_path / "python", SLOW_PROBE), tmp_path / "probe.pids"
    no_tools = tmp_path / "bin"  # no nvidia-smi: torch is asked
    no_tools.mkdir()
    argv = ["serve", "--model", str(tmp_path), "--checkpoint-path", str(tmp_path / "made" / "root"), "--device", "auto"]
    argv += ["--port", str(free_port()), "--sidecar-port", str(free_port())]
    serve = subprocess.Popen(
        [sys.executable, "-c", SERVE_WITH, str(probe), *argv],
        cwd=REPO,
        env={**os.environ, "PATH": str(no_tools), "PROBE_PIDS": str(pids)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(lambda: _pids(pids) or serve.poll() is not None, 60, "the CUDA probe")
        assert serve.poll() is None, serve.communicate()
        serve.send_signal(sig)
        _out, err = serve.communicate(timeout=60)
        assert serve.returncode == 0, err
        assert f"interrupted by {signal.Signals(sig).name} during serve's start-up" in err
        _wait_for(lambda: _gone(_pids(pids)[0]), 10, "the probe to end with serve")
        assert not (tmp_path / "made").exists()  # the root made for it is removed again
    finally:
        if serve.poll() is None:
            serve.kill()
        for pid in _pids(pids):
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_an_interrupt_during_sglangs_cuda_probe_launches_nothing(tmp_path: Path, monkeypatch) -> None:
    """Before, `Supervisor.interrupt` during `start()`'s CUDA probe did nothing until the probe
    ended, and SGLang was then launched anyway."""
    pids = tmp_path / "probe.pids"
    monkeypatch.setenv("PROBE_PIDS", str(pids))
    monkeypatch.setenv("PROBE_SLEEP", "5")  # then "torch sees CUDA"
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    python = _script(tmp_path / "python", SLOW_PROBE)
    server = SGLangServer(tmp_path, device="cuda", python=str(python), port=free_port(), log_path=tmp_path / "s.log")
    supervisor = Supervisor(server, RestartPolicy(startup_timeout_s=30.0))
    raised: list[BaseException] = []

    def startup() -> None:
        try:
            supervisor.startup()
        except BaseException as exc:
            raised.append(exc)

    starting = threading.Thread(target=startup, daemon=True)
    starting.start()
    try:
        _wait_for(lambda: _pids(pids), 30, "the CUDA probe")
        interrupted = time.monotonic()
        supervisor.interrupt(signal.SIGTERM)
        starting.join(30)
        assert time.monotonic() - interrupted < 3.0, "the probe was not ended"
        assert raised and isinstance(raised[0], SGLangStartError), raised
        assert server.pid is None, "SGLang was launched after the interrupt"
        assert _gone(_pids(pids)[0])
    finally:
        starting.join(30)
        supervisor.shutdown()
        for pid in _pids(pids):
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------- 7. the demo's numbers


OUT_OF_RANGE = [
    ("--num-generations", "0"),
    ("--num-generations", "1"),
    ("--steps", "-3"),
    ("--prompts-per-step", "0"),
    ("--max-completion-length", "0"),
    ("--learning-rate", "nan"),
    ("--learning-rate", "-1"),
    ("--seed", "-1"),
]


@pytest.mark.parametrize("flag, value", OUT_OF_RANGE)
def test_demo_refuses_numbers_outside_their_range_naming_the_flag(capsys, flag: str, value: str) -> None:
    """Before, ``--num-generations 0`` was a ZeroDivisionError traceback and ``--steps -3`` ran."""
    from rollout_demo.cli import build_parser as demo_parser

    with pytest.raises(SystemExit) as exc:
        demo_parser().parse_args(["demo", f"{flag}={value}"])
    assert exc.value.code == 2
    assert f"argument {flag}: must be a finite number from" in capsys.readouterr().err


def test_demo_takes_its_defaults_and_numbers_in_range() -> None:
    from rollout_demo.cli import build_parser as demo_parser

    args = demo_parser().parse_args(["demo", "--num-generations", "2", "--learning-rate", "0"])
    assert (args.num_generations, args.learning_rate, args.steps, args.seed) == (2, 0.0, 20, 0)


# --------------------------------------------------------- 8. open to the network without credentials


def test_serve_warns_of_sidecar_and_sglang_listening_beyond_this_machine_without_credentials(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    def no_sglang(self) -> None:
        raise SGLangStartError("stand-in: SGLang not started")

    monkeypatch.setattr(Supervisor, "startup", no_sglang)
    root = tmp_path / "root"
    root.mkdir()
    server = SGLangServer(tmp_path, device="cpu", host="0.0.0.0", port=free_port(), log_path=tmp_path / "s.log")

    def settings(**credentials: str) -> SidecarSettings:
        return SidecarSettings(
            checkpoint_path=root,
            sglang_url=server.url,
            host="0.0.0.0",
            port=free_port(),
            stage_dir=tmp_path / "stage",
            **credentials,
        )

    with caplog.at_level(logging.WARNING):
        assert run_serve(server, settings(), RestartPolicy()) == 2
    assert "the sidecar listens on 0.0.0.0 without a token" in caplog.text
    assert "SGLang listens on 0.0.0.0 without an API key" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert run_serve(server, settings(token="t0ken", sglang_api_key="k3y"), RestartPolicy()) == 2
    assert "without a token" not in caplog.text and "without an API key" not in caplog.text


def test_the_sidecar_alone_is_warned_about_only_for_its_own_port(tmp_path: Path) -> None:
    from rollout_service.sidecar.settings import unguarded_listeners

    root = tmp_path / "root"
    root.mkdir()

    def settings(host: str) -> SidecarSettings:
        return SidecarSettings(checkpoint_path=root, sglang_url="http://10.0.0.1:30000", host=host, stage=False)

    found = unguarded_listeners(settings("0.0.0.0"))
    assert [message.split(" without")[0] for message in found] == ["the sidecar listens on 0.0.0.0"]
    assert unguarded_listeners(settings("127.0.0.2"), "::1") == []


# -------------------------------------------------------------- 9. nothing made before the checks


@pytest.mark.parametrize("flags", [["--device", "gpu"], ["--replica-id", "not/a/name"], ["--token", "pässwort"]])
def test_a_refused_serve_leaves_no_checkpoint_root_behind(capsys, tmp_path: Path, recorded: dict, flags) -> None:
    rc, err = _serve(capsys, tmp_path, *flags, root=tmp_path / "made" / "for" / "root")
    assert rc == 2 and not recorded, err
    assert not (tmp_path / "made").exists(), "serve made the checkpoint root before refusing its settings"


def test_sglangs_temporary_log_is_removed_when_it_stops_unless_it_failed(tmp_path: Path, caplog) -> None:
    unused = SGLangServer(tmp_path, device="cpu", port=free_port())
    assert unused.log_path.exists()
    unused.stop()
    assert not unused.log_path.exists(), "the temporary log outlived the server"
    failing = SGLangServer(
        tmp_path,
        device="cpu",
        port=free_port(),
        python=str(_script(tmp_path / "python", "import sys; print('the last words'); sys.exit(1)")),
    )
    try:
        failing.start()
        with pytest.raises(SGLangStartError, match=str(failing.log_path)):
            failing.wait_healthy(60)
        with caplog.at_level(logging.WARNING):
            failing.stop()
        assert "the last words" in failing.log_path.read_text()  # kept for the error that names it
        assert f"its log is kept at {failing.log_path}" in caplog.text
    finally:
        failing.log_path.unlink(missing_ok=True)


# ------------------------------------------------------------------------------- 10. texts


def test_replica_id_help_names_the_port_flag_of_each_command() -> None:
    def help_text(command: str) -> str:
        action = next(a for a in build_parser()._actions if a.dest == "command")
        return " ".join(action.choices[command].format_help().split())  # type: ignore[union-attr]

    assert "default: HOSTNAME-PORT, PORT being the sidecar's --sidecar-port)" in help_text("serve")
    assert "default: HOSTNAME-PORT, PORT being the sidecar's --port)" in help_text("sidecar")


def test_materialize_under_a_file_says_a_part_of_the_path_is_no_directory(capsys, tmp_path: Path) -> None:
    """Before: "Not a directory (a full or read-only disk? ...)"."""
    from test_cli_validate_kinds import publish_delta_chain

    root = tmp_path / "root"
    publish_delta_chain(root)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    rc = main(["materialize", str(root), "--step", "2", "--out", str(a_file / "sub" / "x")])
    err = capsys.readouterr().err
    assert rc == 2 and "Not a directory" in err and "is not a directory: name an --out" in err, err
    assert "full or read-only" not in err


# ----------------------------------------------------------- 11. a process group's number reused

SPAWNS_A_DETACHED_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""

LEAVES_A_CHILD = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
sys.exit(3)
"""


def test_stop_after_the_leader_was_reaped_never_signals_whoever_has_its_number_now(tmp_path: Path) -> None:
    """The group's id is the reaped leader's pid, which the system may give to a new process:
    before, a later `stop()` (serve's shutdown) killed that process's group and its children's."""
    group = ProcessGroup([sys.executable, "-c", "pass"], tmp_path / "g.log", name="stand-in")
    group.start()
    _wait_for(lambda: group.returncode is not None, 30, "the leader to exit")
    stranger = subprocess.Popen(
        [sys.executable, "-c", SPAWNS_A_DETACHED_CHILD],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert stranger.stdout is not None
    grandchild = int(stranger.stdout.readline())
    try:
        assert group.process is not None
        group.process.pid = stranger.pid  # as if the system had reused the number
        group.stop(timeout_s=2, reap_timeout_s=2)
        assert stranger.poll() is None, "stop() signalled the process group that now has the number"
        assert not _gone(grandchild), "stop() signalled the group of that process's child"
    finally:
        for pgid in (stranger.pid, grandchild):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stranger.wait(10)


def test_stop_still_ends_the_children_of_a_leader_that_exited_and_was_reaped(tmp_path: Path) -> None:
    group = ProcessGroup([sys.executable, "-c", LEAVES_A_CHILD], tmp_path / "g.log", name="stand-in")
    group.start()
    _wait_for(lambda: group.log_tail().strip() and not group.is_running(), 30, "the leader to exit")
    child = int(group.log_tail().split()[0])
    assert not _gone(child) and os.getpgid(child) == group.pid
    group.stop(timeout_s=5)
    _wait_for(lambda: _gone(child), 10, "the child the leader left in its group to end")


def test_a_tilde_checkpoint_path_from_the_environment_is_one_folder_for_serve_and_its_sidecar(
    capsys, tmp_path: Path, recorded: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``~`` in ROLLOUT_CHECKPOINT_PATH reaches the program unexpanded: serve made ``./~/ckpt``
    while its sidecar watched ``$HOME/ckpt`` (and refused it: not a directory)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("ROLLOUT_CHECKPOINT_PATH", "~/ckpt")
    monkeypatch.chdir(work)
    rc = main(["serve", "--model", str(tmp_path), "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    assert recorded["settings"].checkpoint_path == home / "ckpt" and (home / "ckpt").is_dir()
    assert list(work.iterdir()) == []  # no folder named '~' in the working directory


@pytest.mark.parametrize("flag", ["--checkpoint-path", "--stage-dir"])
def test_a_tilde_of_a_user_with_no_home_is_refused_naming_the_flag_not_a_traceback(
    capsys, tmp_path: Path, flag: str
) -> None:
    paths = {"--checkpoint-path": str(tmp_path), "--stage-dir": str(tmp_path / "stage")}
    paths[flag] = "~no_such_user_zz91/x"
    argv = ["sidecar", "--sglang-url", "http://127.0.0.1:1"]
    argv += [a for pair in paths.items() for a in pair]
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc != 0 and f"{flag} '~no_such_user_zz91/x' starts with ~" in err and "Traceback" not in err, err
    with pytest.raises(ValueError, match="no_such_user_zz91"):
        SidecarSettings(checkpoint_path="~no_such_user_zz91/x", sglang_url="http://127.0.0.1:1", replica_id="r")
