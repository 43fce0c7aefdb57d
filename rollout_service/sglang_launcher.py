"""Start, watch and stop a real SGLang HTTP server as a child process group.

`SGLangServer` owns one `python -m sglang.launch_server` process: it picks the flags for the
device (CUDA with SGLang's defaults, or the CPU engine with this project's `sgl_kernel`
stand-in on `PYTHONPATH`), sends the server's output to a log file, polls `/health` until the
server answers, and on `stop()` terminates the whole process group so that no scheduler or
detokenizer child outlives it.

This module imports neither torch nor sglang: the slim sidecar container imports it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Mapping, Sequence

import httpx

logger = logging.getLogger(__name__)

CPU_SHIMS_DIR = Path(__file__).resolve().parent / "_cpu_shims"
"""Folder whose `sgl_kernel` package stands in for the CUDA-only kernels on CPU machines."""

DEVICES = ("auto", "cuda", "cpu")
LOG_TAIL_LINES = 40
PROGRESS_EVERY_S = 10.0


class SGLangStartError(RuntimeError):
    """The SGLang server did not become healthy: it exited early or timed out."""


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on `host` that was free when asked (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def detect_device() -> str:
    """Return "cuda" when `nvidia-smi -L` succeeds and lists a GPU, else "cpu"."""
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return "cpu"
    try:
        result = subprocess.run(
            [nvidia_smi, "-L"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    if result.returncode == 0 and "GPU" in result.stdout:
        return "cuda"
    return "cpu"


@dataclass
class SGLangServerConfig:
    """Settings of one SGLang server process.

    Arguments:
        model_path: local model folder (or anything SGLang's `--model-path` accepts).
        host: interface to bind.
        port: TCP port; None picks a free one when the server starts.
        device: "auto" (CUDA if `nvidia-smi -L` lists a GPU, else CPU), "cuda" or "cpu".
        max_total_tokens: KV-cache size in tokens, used on CPU only (unbounded, SGLang reserves
            ~15 GB of RAM there). On CUDA SGLang sizes the cache itself; pass
            `--max-total-tokens` or `--mem-fraction-static` through `extra_args` to change it.
        python: interpreter that runs `sglang.launch_server`.
        extra_args: appended verbatim after all other flags (e.g. `--mem-fraction-static 0.5`).
        env: extra environment variables for the server process.
        log_path: file receiving the server's stdout and stderr; None makes a temporary file.
    """

    model_path: str | os.PathLike[str]
    host: str = "127.0.0.1"
    port: int | None = None
    device: str = "auto"
    max_total_tokens: int = 16384
    python: str = sys.executable
    extra_args: Sequence[str] = field(default_factory=tuple)
    env: Mapping[str, str] = field(default_factory=dict)
    log_path: str | os.PathLike[str] | None = None
    die_with_parent: bool = False

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(
                f"device must be one of {DEVICES}, got {self.device!r}; "
                "use 'auto' to pick CUDA when a GPU is listed by nvidia-smi"
            )


class SGLangServer:
    """One SGLang HTTP server process group, from start to a clean stop.

    Typical use::

        with SGLangServer(model_dir, device="cpu") as server:
            httpx.post(f"{server.url}/generate", json=...)

    `start()` launches the process, `wait_healthy()` blocks until `/health` answers (raising
    `SGLangStartError` with the log tail when the process exits or the time runs out), `stop()`
    terminates the whole process group. The arguments are those of `SGLangServerConfig`.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        device: str = "auto",
        max_total_tokens: int = 16384,
        python: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.config = SGLangServerConfig(
            model_path=model_path,
            host=host,
            port=port,
            device=device,
            max_total_tokens=max_total_tokens,
            python=python or sys.executable,
            extra_args=tuple(extra_args),
            env=dict(env or {}),
            log_path=log_path,
            die_with_parent=die_with_parent,
        )
        config = self.config
        self.device = detect_device() if config.device == "auto" else config.device
        self.port = config.port if config.port is not None else free_port(config.host)
        if config.log_path is None:
            fd, name = tempfile.mkstemp(prefix="sglang-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        else:
            self.log_path = Path(config.log_path)
        self._process: subprocess.Popen[bytes] | None = None
        self._pgid: int | None = None

    @classmethod
    def from_config(cls, config: SGLangServerConfig) -> "SGLangServer":
        """Build a server from a `SGLangServerConfig` (e.g. one filled from CLI flags)."""
        return cls(
            config.model_path,
            host=config.host,
            port=config.port,
            device=config.device,
            max_total_tokens=config.max_total_tokens,
            python=config.python,
            extra_args=config.extra_args,
            env=config.env,
            log_path=config.log_path,
            die_with_parent=config.die_with_parent,
        )

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. "http://127.0.0.1:30000"."""
        return f"http://{self.config.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id of the server's main process (also its process-group id), or None."""
        return self._process.pid if self._process is not None else None

    @property
    def pgid(self) -> int | None:
        """Process-group id of the server and all its children, or None before `start()`."""
        return self._pgid

    def command(self) -> list[str]:
        """The command line that `start()` runs."""
        cfg = self.config
        cmd = [
            cfg.python, "-m", "sglang.launch_server",
            "--model-path", os.fspath(cfg.model_path),
            "--host", cfg.host,
            "--port", str(self.port),
        ]
        if self.device == "cpu":
            cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--skip-server-warmup"]
            cmd += ["--max-total-tokens", str(cfg.max_total_tokens)]
            if not any(a == "--dtype" or a.startswith("--dtype=") for a in cfg.extra_args):
                # SGLang's "auto" serves float32 checkpoints as float16, which makes rollout
                # logprobs disagree with a float32 trainer on CPU. Pass --dtype to override.
                cmd += ["--dtype", "float32"]
            # Without it the idle scheduler busy-polls a core (95% CPU measured), which slows a
            # trainer sharing the CPU many times over; with it: ~1% idle, same answers.
            if "--sleep-on-idle" not in cfg.extra_args:
                cmd += ["--sleep-on-idle"]
        cmd += list(cfg.extra_args)
        return cmd

    def environment(self) -> dict[str, str]:
        """The environment that `start()` gives the server process."""
        env = dict(os.environ)
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            previous = env.get("PYTHONPATH")
            env["PYTHONPATH"] = os.pathsep.join(
                [str(CPU_SHIMS_DIR)] + ([previous] if previous else [])
            )
        env.update(self.config.env)
        return env

    def start(self) -> None:
        """Launch the server process group; returns at once (see `wait_healthy`)."""
        if self.is_running():
            raise RuntimeError(f"SGLang server already running with pid {self.pid}; stop() it first")
        cmd = self.command()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("starting SGLang on %s (%s), log %s: %s", self.url, self.device, self.log_path,
                    " ".join(cmd))
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
                preexec_fn=kill_me_with_parent if self.config.die_with_parent else None,
            )
        self._pgid = self._process.pid

    def is_running(self) -> bool:
        """True while the server's main process has not exited."""
        return self._process is not None and self._process.poll() is None

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Block until GET /health answers 200.

        Raises:
            SGLangStartError: the process exited first (with its exit code) or `timeout_s`
                passed; the message holds the last lines of the server log.
        """
        if self._process is None:
            raise RuntimeError("wait_healthy() called before start()")
        started = time.monotonic()
        next_report = started + PROGRESS_EVERY_S
        with httpx.Client(timeout=httpx.Timeout(5.0, connect=2.0)) as client:
            while True:
                code = self._process.poll()
                if code is not None:
                    raise SGLangStartError(
                        f"SGLang server exited with code {code} before /health answered "
                        f"(log {self.log_path}); last log lines:\n{self.log_tail(LOG_TAIL_LINES)}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        logger.info("SGLang healthy at %s after %.0f s", self.url,
                                    time.monotonic() - started)
                        return
                except httpx.HTTPError:
                    pass
                now = time.monotonic()
                if now - started > timeout_s:
                    raise SGLangStartError(
                        f"SGLang /health at {self.url} did not answer within {timeout_s:.0f} s "
                        f"(process {self.pid} still running; log {self.log_path}); a slow machine "
                        f"may need a larger timeout. Last log lines:\n"
                        f"{self.log_tail(LOG_TAIL_LINES)}"
                    )
                if now >= next_report:
                    logger.info("waiting for SGLang /health at %s (%.0f s elapsed)", self.url,
                                now - started)
                    next_report = now + PROGRESS_EVERY_S
                time.sleep(0.5)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Terminate the whole process group: SIGTERM, then SIGKILL after `timeout_s`.

        Safe to call more than once, and also when the main process already died (its
        children are still killed through the process group).
        """
        if self._process is None or self._pgid is None:
            return
        pgid = self._pgid
        if _group_alive(pgid):
            logger.info("stopping SGLang process group %d", pgid)
            _signal_group(pgid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                self._process.poll()
                if not _group_alive(pgid):
                    break
                time.sleep(0.2)
            else:
                logger.warning("SGLang process group %d ignored SIGTERM for %.0f s; sending SIGKILL",
                               pgid, timeout_s)
                _signal_group(pgid, signal.SIGKILL)
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(pgid, signal.SIGKILL)
            self._process.wait()
        deadline = time.monotonic() + 10
        while _group_alive(pgid) and time.monotonic() < deadline:
            _signal_group(pgid, signal.SIGKILL)
            time.sleep(0.1)

    def restart(self, timeout_s: float = 300.0) -> None:
        """Stop the server (if running), start it again on the same port and wait healthy."""
        self.stop()
        self.start()
        self.wait_healthy(timeout_s)

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        """The last `n` lines of the server log ("" when there is no log yet)."""
        try:
            with open(self.log_path, "rb") as log:
                lines = deque(log, maxlen=n)
        except FileNotFoundError:
            return ""
        return b"".join(lines).decode("utf-8", errors="replace")

    def __enter__(self) -> "SGLangServer":
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    """True while any process of group `pgid` exists (zombies included)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def kill_me_with_parent() -> None:
    """In the child before exec: SIGKILL this process when the thread that started it dies.

    SGLang's own worker processes already die with the server process, so a killed test
    run or supervisor never leaves a server behind (Linux only; a no-op elsewhere).
    """
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
