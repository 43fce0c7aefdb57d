"""Start, watch and stop a real SGLang HTTP server as a child process group.

`SGLangServer` owns one `python -m sglang.launch_server` process: it picks the flags for the
device (CUDA with SGLang's defaults, or the CPU engine with this project's `sgl_kernel`
stand-in on `PYTHONPATH`) and runs it as a `process_group.ProcessGroup`: the server's output
goes to a log file, `/health` is polled until the server answers, and `stop()` terminates the
whole process group so that no scheduler or detokenizer child outlives it.

This module imports neither torch nor sglang: the slim sidecar container imports it.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from .cli_env import check_bounds, declared_settings, setting
from .http_urls import bindable_port, check_bind_host, port_in_use, url_host
from .lora_serving import LoraServing
from .number_text import digits_value
from .process_group import (
    LOG_ROTATE_BYTES,
    LOG_TAIL_LINES,
    ProcessGroup,
    ProcessStartError,
    describe_pids,
    kill_me_with_parent,
    log_path_problem,
    log_tail,
    port_listeners,
    rotate_log,
)
from .redaction import shown_command, spellings
from .sglang_key import key_off_command_line, remove_key_file

logger = logging.getLogger(__name__)

CPU_SHIMS_DIR = Path(__file__).resolve().parent / "_cpu_shims"
"""Folder whose `sgl_kernel` package stands in for the CUDA-only kernels on CPU machines."""

DEVICES = ("auto", "cuda", "cpu")


class SGLangStartError(ProcessStartError):
    """The SGLang server did not become healthy: it exited early or timed out."""


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on `host` that was free when asked (the OS picks it); a ValueError
    when `host` is not an address of this machine."""
    return bindable_port(host, 0, "the SGLang server's host")


def server_url(host: str, port: int) -> str:
    """The base URL of an SGLang server bound to ``host`` and ``port`` ("http://127.0.0.1:30000")."""
    return f"http://{url_host(host)}:{port}"


def listed_gpus() -> list[str]:
    """The GPUs `nvidia-smi -L` lists ("GPU 0: NVIDIA H200 (UUID: ...)"); [] without nvidia-smi."""
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return []
    try:
        result = subprocess.run([nvidia_smi, "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    if result.returncode != 0:
        return []
    return [line.strip() for line in result.stdout.splitlines() if line.strip().startswith("GPU")]


CUDA_PROBE_TIMEOUT_S = 300.0
"""How long `torch_sees_cuda` waits for torch to answer (importing it and initialising CUDA)."""


def torch_sees_cuda(
    python: str | None = None, *, probe_started: Callable[[subprocess.Popen[bytes]], None] | None = None
) -> bool:
    """Whether torch in `python` (default: this interpreter) reports a usable CUDA device.

    Asked in a child process so that this module never imports torch (the slim sidecar has none).
    The child never outlives the wait: it is killed when the wait is interrupted (Ctrl-C, or a
    signal handler that raises) and dies with the thread that started it (`kill_me_with_parent`);
    `probe_started` is handed it, so that a signal handler can kill it (`SGLangServer.interrupt`),
    which counts as no CUDA.
    """
    argv = [python or sys.executable, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"]
    try:
        probe = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=kill_me_with_parent,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    with probe:
        try:
            if probe_started is not None:
                probe_started(probe)
            return probe.wait(timeout=CUDA_PROBE_TIMEOUT_S) == 0
        except subprocess.TimeoutExpired:
            return False
        finally:
            if probe.poll() is None:
                probe.kill()


TORCH_CUDA_DRIVER_FLOOR = "580"
"""torch 2.14.1+cu130 (what sglang 0.5.23 pins on PyPI) needs an NVIDIA driver of at least this major."""


def driver_version() -> str | None:
    """The NVIDIA driver version nvidia-smi reports (e.g. "570.124.06"), or None."""
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return None
    try:
        result = subprocess.run(
            [nvidia_smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
    return lines[0] if result.returncode == 0 and lines else None


def cuda_unavailable_message(gpus: Sequence[str], who: str, torch_version: str | None = None) -> str:
    """Why torch sees no GPU although `gpus` are listed, and what to do (for a loud failure); with
    none listed, that there is no GPU here at all (no driver to blame)."""
    if not gpus:
        return (
            f"{who}: no NVIDIA GPU found (nvidia-smi is missing or lists none) and torch"
            f"{' ' + torch_version if torch_version else ''} sees no CUDA device (torch.cuda.is_available() is"
            " False): this machine has no GPU"
            " to run on. Use --device cpu (or auto, which picks the CPU here); on a GPU machine, install"
            " the NVIDIA driver first (README, 'Install on GPU machines'). Not falling back to the CPU."
        )
    driver = driver_version()
    listed = "; ".join(gpus[:4]) + (f"; ... ({len(gpus)} in all)" if len(gpus) > 4 else "")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (
        f"{who}: nvidia-smi lists {len(gpus)} GPU(s) ({listed}) but torch"
        f"{' ' + torch_version if torch_version else ''} sees none (torch.cuda.is_available() is False)"
        f"{'' if visible is None else f'; CUDA_VISIBLE_DEVICES={visible!r}'}. "
        f"torch 2.14.1+cu130 needs NVIDIA driver >= {TORCH_CUDA_DRIVER_FLOOR}"
        f"{f' (this machine has {driver})' if driver else ''}: upgrade the driver, or install a torch"
        " built for the CUDA your driver supports (pip install torch==<version> --index-url"
        " https://download.pytorch.org/whl/cu1XX; README, 'Install on GPU machines'). Check"
        " CUDA_VISIBLE_DEVICES names GPUs that exist. Not falling back to the CPU."
    )


def detect_device(python: str | None = None) -> str:
    """ "cuda" when `nvidia-smi -L` lists a GPU or torch in `python` sees CUDA, else "cpu"."""
    if listed_gpus():
        return "cuda"
    return "cuda" if torch_sees_cuda(python) else "cpu"


def _is_cpu_shims_dir(entry: str) -> bool:
    """True for this project's stand-in folder: the package's own, a link to it, or a copy."""
    if not entry:
        return False
    try:
        if Path(entry).resolve() == CPU_SHIMS_DIR:
            return True
        init = Path(entry) / "sgl_kernel" / "__init__.py"
        return init.is_file() and "IS_STAND_IN = True" in init.read_text(errors="replace")
    except OSError:
        return False


def cuda_environment(env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """`env` without the CPU-only settings (the `sgl_kernel` stand-in on PYTHONPATH,
    SGLANG_USE_CPU_ENGINE); returns the new environment and what was removed."""
    out = dict(env)
    removed = []
    if "SGLANG_USE_CPU_ENGINE" in out:
        removed.append(f"SGLANG_USE_CPU_ENGINE={out.pop('SGLANG_USE_CPU_ENGINE')}")
    if out.get("PYTHONPATH"):
        entries = out["PYTHONPATH"].split(os.pathsep)
        kept = [e for e in entries if not _is_cpu_shims_dir(e)]
        if len(kept) != len(entries):
            removed += [f"PYTHONPATH entry {e}" for e in entries if _is_cpu_shims_dir(e)]
            if kept:
                out["PYTHONPATH"] = os.pathsep.join(kept)
            else:
                del out["PYTHONPATH"]
    return out, removed


def flag_values(args: Sequence[str], *names: str) -> list[str]:
    """The values given to any of ``names`` in an argument list (``--flag VALUE`` or
    ``--flag=VALUE``), in order."""
    found = []
    for i, arg in enumerate(args):
        option, equals, value = arg.partition("=")
        if option in names:
            if equals:
                found.append(value)
            elif i + 1 < len(args):
                found.append(args[i + 1])
    return found


def flag_value(args: Sequence[str], *names: str) -> str | None:
    """The value the last of ``names`` is given in an argument list: the one SGLang uses
    (argparse keeps the last); None when none is given."""
    found = flag_values(args, *names)
    return found[-1] if found else None


def _count_flag(args: Sequence[str], default: int, *names: str) -> int | None:
    """The whole number given to the last of ``names`` (``default`` when none is); None when it is
    not plain ASCII digits (SGLang's own parser then refuses it with its message)."""
    value = flag_value(args, *names)
    return default if value is None else digits_value(value.strip())


def quiet_http_log(args: Sequence[str]) -> list[str]:
    """``--log-level-http`` at `HTTP_LOG_LEVEL`, unless SGLang's arguments ``args`` set it."""
    return [] if _has_flag(args, *LOG_LEVEL_HTTP_OPTIONS) else ["--log-level-http", HTTP_LOG_LEVEL]


def _has_flag(args: Sequence[str], *names: str) -> bool:
    return any(a in names or a.split("=", 1)[0] in names for a in args)


OWN_SGLANG_OPTIONS: dict[str, tuple[str, ...]] = {
    "model_path": (*spellings("--model-path", "--model-p"), "--model"),
    "host": spellings("--host", "--ho"),
    "port": spellings("--port", "--po"),
}
"""SGLang's options that `SGLangServerConfig` fields set, by field, as SGLang 0.5.23's parser takes
them (``--model`` is ``--model-path``'s alias; each abbreviation no other option of it shares).
Given again in ``extra_args`` (after ``serve --``) one would win, argparse keeping the last: SGLang
would listen elsewhere than `SGLangServer.url` (where the supervisor and the sidecar look) or
serve another model than the one the sidecar checks checkpoints against."""


LOG_LEVEL_HTTP_OPTIONS = spellings("--log-level-http", "--log-level-")
"""SGLang 0.5.23's ``--log-level-http`` as its parser takes it (``--log-level`` is another option)."""
HTTP_LOG_LEVEL = "warning"
"""The ``--log-level-http`` SGLang is started with unless the arguments after ``--`` give one: at
SGLang's default (its ``--log-level``, info) every request is an access line in its log, and the
sidecar polls SGLang every few seconds, for days."""


def _setting_flag(name: str) -> str:
    """The flag of `SGLangServerConfig`'s setting ``name`` (``--port``)."""
    return next(declaration.flag for f, declaration in declared_settings(SGLangServerConfig) if f.name == name)


def _own_options_problem(extra_args: Sequence[str]) -> str | None:
    """Why ``extra_args`` cannot go to SGLang: they set an option a setting sets (`OWN_SGLANG_OPTIONS`)."""
    for arg in extra_args:
        option = arg.split("=", 1)[0]
        for name, options in OWN_SGLANG_OPTIONS.items():
            if option in options:
                flag = _setting_flag(name)
                return (
                    f"{option} after '--' would set SGLang's {max(options, key=len)}, which serve sets from its own"
                    f" {flag}: SGLang keeps the last one given, so serve and its sidecar would look for another"
                    f" server than the one SGLang runs; give it as serve's {flag} instead (before '--')"
                )
    return None


def log_file(text: str) -> Path:
    """``--sglang-log``'s text as a path: empty is refused (``Path("")`` is the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must name a file, got {text!r}: leave the flag out for a temporary file")
    return Path(text)


@dataclass(frozen=True)
class GPUMemory:
    """One GPU as nvidia-smi reports it, and the memory other processes hold on it."""

    index: int
    uuid: str
    total_mib: float
    used_mib: float
    processes: tuple[str, ...] = ()

    @property
    def free_fraction(self) -> float:
        return max(0.0, (self.total_mib - self.used_mib) / self.total_mib) if self.total_mib else 0.0


def query_gpu_memory() -> list[GPUMemory]:
    """Every GPU's total/used memory and compute processes (nvidia-smi); [] when unavailable."""
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is None:
        return []

    def query(*args: str) -> list[list[str]]:
        try:
            result = subprocess.run(
                [nvidia_smi, *args, "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            return []
        if result.returncode != 0:
            return []
        return [[c.strip() for c in line.split(",")] for line in result.stdout.splitlines() if line.strip()]

    apps: dict[str, list[str]] = {}
    for row in query("--query-compute-apps=gpu_uuid,pid,process_name,used_memory"):
        if len(row) >= 4:
            apps.setdefault(row[0], []).append(f"pid {row[1]} {row[2]} ({row[3]} MiB)")
    gpus = []
    for row in query("--query-gpu=index,uuid,memory.total,memory.used"):
        try:
            gpus.append(GPUMemory(int(row[0]), row[1], float(row[2]), float(row[3]), tuple(apps.get(row[1], ()))))
        except (IndexError, ValueError):  # "[N/A]": leaving it out would shift every GPU after it
            logger.info("nvidia-smi's row %r cannot be read: SGLang keeps its own GPU memory share", row)
            return []
    return gpus


def gpus_for_server(gpus: Sequence[GPUMemory], visible: str | None, ids: Sequence[int]) -> list[GPUMemory]:
    """The GPUs at positions ``ids`` (:func:`server_gpu_ids`) of CUDA_VISIBLE_DEVICES' order.

    Read as CUDA reads it: each item is an index (ASCII digits) or a ``GPU-``/``MIG-`` UUID
    prefix, and the first item that names no GPU (empty, anything else, or matching none) hides
    it and every item after it (CUDA's documented rule)."""
    if visible is not None and visible.strip() != "":
        order: list[GPUMemory] = []
        for item in visible.split(","):
            item = item.strip()
            if (index := digits_value(item)) is not None:
                match = [g for g in gpus if g.index == index]
            elif item[:4] in ("GPU-", "MIG-") and len(item) > 4:
                match = [g for g in gpus if g.uuid.startswith(item)]
            else:
                match = []
            if not match or match[0] in order:
                break
            order.append(match[0])
    else:
        order = sorted(gpus, key=lambda g: g.index)
    return [order[i] for i in ids if 0 <= i < len(order)]


GPU_LAYOUT_OPTIONS: dict[str, tuple[tuple[str, ...], int]] = {
    "tp": ((*spellings("--tp-size", "--tp"), *spellings("--tensor-parallel-size", "--te")), 1),
    "pp": ((*spellings("--pp-size", "--pp-s"), *spellings("--pipeline-parallel-size", "--pi")), 1),
    "dp": ((*spellings("--dp-size", "--dp"), *spellings("--data-parallel-size", "--da")), 1),
    "base": (spellings("--base-gpu-id", "--bas"), 0),
    "step": (spellings("--gpu-id-step", "--gp"), 1),
    "nnodes": (spellings("--nnodes", "--nn"), 1),
}
"""SGLang 0.5.23's options that place a server's workers on GPUs, as its parser takes them (each
abbreviation no other option shares), and their defaults."""
MAX_SERVER_GPUS = 4096


def server_gpu_ids(args: Sequence[str]) -> list[int] | None:
    """The GPUs (positions in CUDA_VISIBLE_DEVICES' order) one SGLang 0.5.23 server with the
    arguments ``args`` puts its workers on: ``dp`` groups (one, with ``--enable-dp-attention``)
    of ``pp x tp`` workers from ``--base-gpu-id``, ``--gpu-id-step`` apart, as its data-parallel
    controller and engine place them. None when a value is not a count (SGLang's parser refuses
    it, naming it) or the server spans nodes (``--nnodes``)."""
    values = {}
    for key, (names, default) in GPU_LAYOUT_OPTIONS.items():
        value = _count_flag(args, default, *names)
        if value is None:
            return None
        values[key] = value
    tp, pp, dp, base, step = (values[k] for k in ("tp", "pp", "dp", "base", "step"))
    if values["nnodes"] != 1 or min(tp, pp, dp, step) < 1:
        return None
    groups = dp if dp > 1 and not _has_flag(args, "--enable-dp-attention") else 1
    if tp * pp * groups > MAX_SERVER_GPUS:
        return None
    ids = {
        base + group * tp * pp * step + pp_rank * tp + tp_rank * step
        for group in range(groups)
        for pp_rank in range(pp)
        for tp_rank in range(tp)
    }
    return sorted(ids)


SHARED_GPU_USED_MIB = 1024.0
"""Memory other processes must hold on a GPU before SGLang's share of it is reduced."""
SGLANG_AUTO_FRACTION = 0.9
"""About what SGLang takes of a GPU by default (its automatic --mem-fraction-static, ~0.93 on an H200)."""


def shared_gpu_mem_fraction(gpus: Sequence[GPUMemory]) -> tuple[float | None, str]:
    """A `--mem-fraction-static` for SGLang when other processes already use its GPUs.

    Returns (None, "") when they are free. Otherwise the fraction leaves a tenth of the GPU
    beside what is free (SGLang's own activations, CUDA graphs), at least 0.05, and a message
    that says what was chosen and why.
    """
    busy = [g for g in gpus if g.used_mib >= SHARED_GPU_USED_MIB]
    if not busy:
        return None, ""
    fraction = max(0.05, round(min(g.free_fraction for g in busy) - 0.1, 2))
    fraction = min(fraction, SGLANG_AUTO_FRACTION)
    what = "; ".join(
        f"GPU {g.index}: {g.used_mib / 1024:.1f} of {g.total_mib / 1024:.1f} GiB in use"
        + (f" by {', '.join(g.processes)}" if g.processes else "")
        for g in busy
    )
    return fraction, (
        f"SGLang shares its GPU with other processes ({what}); starting it with --mem-fraction-static"
        f" {fraction} instead of SGLang's automatic ~{SGLANG_AUTO_FRACTION}. Pass `-- --mem-fraction-static"
        " X` to choose, or give SGLang and the trainer different GPUs with CUDA_VISIBLE_DEVICES."
    )


@dataclass
class SGLangServerConfig:
    """Settings of one SGLang server process.

    Arguments:
        model_path: local model folder (or anything SGLang's `--model-path` accepts).
        host: interface to bind.
        port: TCP port; None picks a free one when the server starts.
        device: "auto" (CUDA if `nvidia-smi -L` lists a GPU or torch in `python` sees one, else
            CPU), "cuda" or "cpu". On CUDA the CPU-only settings (the `sgl_kernel` stand-in on
            PYTHONPATH, SGLANG_USE_CPU_ENGINE) are removed from the server's environment, and when
            other processes already use the server's GPU a `--mem-fraction-static` that fits is
            chosen (see `cuda_memory_plan`).
        max_total_tokens: KV-cache size in tokens, used on CPU only (unbounded, SGLang reserves
            ~15 GB of RAM there). On CUDA SGLang sizes the cache itself; pass
            `--max-total-tokens` or `--mem-fraction-static` through `extra_args` to change it.
        python: interpreter that runs `sglang.launch_server` (default, or empty: this one).
        extra_args: appended verbatim after all other flags (e.g. `--mem-fraction-static 0.5`).
        env: extra environment variables for the server process.
        log_path: file receiving the server's stdout and stderr; None makes a temporary file.
        die_with_parent: SIGKILL the server when the thread that started it dies (a killed
            supervisor or test run never leaves one behind).
        lora: LoRA serving flags (`rollout_service.lora_serving.LoraServing`); None serves no adapters.
    """

    model_path: str | os.PathLike[str] = field(
        metadata=setting("--model", "HF model directory or Hub id SGLang starts from (base weights)", parse=str)
    )
    host: str = field(default="127.0.0.1", metadata=setting("--sglang-host", "address SGLang binds to"))
    port: int | None = field(default=None, metadata=setting("--port", "SGLang's port", bounds=(1, 65535)))
    device: str = field(default="auto", metadata=setting("--device", "auto, cpu or cuda"))
    max_total_tokens: int = field(
        default=16384,
        metadata=setting(
            "--max-total-tokens",
            "KV cache size in tokens, CPU only (bounded, or SGLang reserves ~15 GB); ignored on CUDA, where"
            " SGLang sizes it from --mem-fraction-static (pass `-- --max-total-tokens N` to set it there)",
            bounds=(16, 1 << 31),
        ),
    )
    python: str = sys.executable
    extra_args: Sequence[str] = field(default_factory=tuple)
    env: Mapping[str, str] = field(default_factory=dict)
    log_path: str | os.PathLike[str] | None = field(
        default=None,
        metadata=setting(
            "--sglang-log",
            "file SGLang's output is appended to (a FIFO or /dev/stdout only while something reads it; default:"
            " a temporary file, removed when SGLang stops unless it failed); a file past 64 MiB is moved to"
            " FILE.1 when SGLang (re)starts, and under serve also while it runs",
            parse=log_file,
        ),
    )
    die_with_parent: bool = False
    lora: LoraServing | None = None

    def __post_init__(self) -> None:
        check_bounds(self)
        check_bind_host(self.host, "--sglang-host")
        self.python = self.python or sys.executable
        self.extra_args = tuple(self.extra_args)
        self.env = dict(self.env or {})
        if self.device not in DEVICES:
            raise ValueError(
                f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}; "
                "use 'auto' to pick CUDA when a GPU is listed by nvidia-smi"
            )
        problem = _own_options_problem(self.extra_args)
        if problem is None and self.log_path is not None:
            problem = log_path_problem(self.log_path, _setting_flag("log_path"))
        if problem:
            raise ValueError(problem)


class SGLangServer:
    """One SGLang HTTP server process group, from start to a clean stop.

    Typical use::

        with SGLangServer(model_dir, device="cpu") as server:
            httpx.post(f"{server.url}/generate", json=...)

    `start()` launches the process, `wait_healthy()` blocks until `/health` answers (raising
    `SGLangStartError` with the log tail when the process exits or the time runs out), `stop()`
    terminates the whole process group. The keyword arguments are the fields of
    `SGLangServerConfig` (declared there, once); a misspelt one is a TypeError at once.
    """

    def __init__(self, model_path: str | os.PathLike[str], **settings: Any) -> None:
        self.config = SGLangServerConfig(model_path, **settings)
        config = self.config
        self.device = detect_device(config.python) if config.device == "auto" else config.device
        self._cuda_plan: tuple[float | None, str] | None = None
        self._cuda_checked = False
        self.port = config.port if config.port is not None else free_port(config.host)
        self._group: ProcessGroup | None = None
        self._probe: subprocess.Popen[bytes] | None = None
        """The CUDA probe `start()` runs, while it runs (`interrupt` kills it)."""
        self._interrupted = False
        """Set by `interrupt()`: `start()` launches nothing until `stop()`."""
        self._temp_log = config.log_path is None
        """Whether the log is a temporary file of this object's: removed by `stop()` unless SGLang failed."""
        self._keep_log = False
        """SGLang failed (an error quoted the log): the temporary log stays, and `stop()` says where."""
        self._said_kept: Path | None = None
        self._key_file: Path | None = None
        """The file SGLang reads its ``--api-key`` from while it runs (:mod:`~rollout_service.sglang_key`)."""
        # Last: the only thing made on disk, once every setting passed.
        self.log_path = self._new_temp_log() if config.log_path is None else Path(config.log_path)

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. "http://127.0.0.1:30000"."""
        return server_url(self.config.host, self.port)

    @property
    def pid(self) -> int | None:
        """Process id of the server's main process (also its process-group id), or None."""
        return self._group.pid if self._group is not None else None

    @property
    def pgid(self) -> int | None:
        """Process-group id of the server and all its children, or None before `start()`."""
        return self.pid

    def command(self) -> list[str]:
        """The command line that `start()` runs."""
        cfg = self.config
        # On every device, and ahead of the device's flags (the deploy manifests repeat those).
        quiet = quiet_http_log(cfg.extra_args)
        cmd = [
            cfg.python,
            "-m",
            "sglang.launch_server",
            *quiet,
            "--model-path",
            os.fspath(cfg.model_path),
            "--host",
            cfg.host,
            "--port",
            str(self.port),
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
        elif self.device == "cuda":
            fraction, why = self.cuda_memory_plan()
            if fraction is not None:
                cmd += ["--mem-fraction-static", str(fraction)]
        if cfg.lora is not None:
            cmd += cfg.lora.sglang_args(self.device)
        cmd += list(cfg.extra_args)
        return cmd

    def cuda_memory_plan(self) -> tuple[float | None, str]:
        """(the --mem-fraction-static to add, the reason) on CUDA; (None, "") to keep SGLang's.

        SGLang takes ~90% of each GPU it uses unless told otherwise; when other processes (a
        trainer) already hold memory there, a fraction that fits beside them is chosen and logged.
        An explicit `--mem-fraction-static` in `extra_args` always wins.
        """
        if self._cuda_plan is None:
            args = self.config.extra_args
            if self.device != "cuda" or _has_flag(args, "--mem-fraction-static"):
                self._cuda_plan = (None, "")
            else:
                ids = server_gpu_ids(args)
                if ids is None:  # not a count (SGLang's own parser refuses it, naming it), or several nodes
                    self._cuda_plan = (None, "")
                else:
                    visible = {**os.environ, **self.config.env}.get("CUDA_VISIBLE_DEVICES")
                    self._cuda_plan = shared_gpu_mem_fraction(gpus_for_server(query_gpu_memory(), visible, ids))
        return self._cuda_plan

    def environment(self) -> dict[str, str]:
        """The environment that `start()` gives the server process."""
        env = dict(os.environ)
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            previous = env.get("PYTHONPATH")
            env["PYTHONPATH"] = os.pathsep.join([str(CPU_SHIMS_DIR)] + ([previous] if previous else []))
        env.update(self.config.env)
        if self.device == "cuda":
            env, removed = cuda_environment(env)
            if removed:
                logger.warning(
                    "SGLang runs on CUDA: not passing the CPU-only settings %s to it (they"
                    " would load the CPU sgl_kernel stand-in)",
                    ", ".join(removed),
                )
        return env

    @staticmethod
    def _new_temp_log() -> Path:
        fd, name = tempfile.mkstemp(prefix="sglang-server-", suffix=".log")
        os.close(fd)
        return Path(name)

    def start(self) -> None:
        """Launch the server process group; returns at once (see `wait_healthy`).

        Each start first checks that SGLang's port can be listened on: another process holding it
        (another ``serve`` with the same ``--port``) fails the start at once, named, rather than
        minutes later when SGLang, its model loaded, cannot bind. A log of more than
        `LOG_ROTATE_BYTES` (64 MiB) is moved to ``<log>.1`` first (`rotate_log`).

        Raises SGLangStartError when CUDA is not usable, when the port is in use, or when
        `interrupt()` was called (before the launch, however long the CUDA checks took); ValueError
        when the log cannot be opened.
        """
        if self.is_running():
            raise RuntimeError(f"SGLang server already running with pid {self.pid}; stop() it first")
        self._refuse_if_interrupted()
        if self.device == "cuda" and not self._cuda_checked:
            sees = torch_sees_cuda(self.config.python, probe_started=self._track_probe)
            self._probe = None
            self._refuse_if_interrupted()
            if not sees:
                raise SGLangStartError(
                    cuda_unavailable_message(listed_gpus(), f"SGLang on CUDA (python {self.config.python})")
                )
            self._cuda_checked = True
        if self._temp_log and not self.log_path.exists():  # stop() removed it: a new one, never a name reused
            self.log_path = self._new_temp_log()
        cmd = self.command()
        if self.device == "cuda":
            fraction, why = self.cuda_memory_plan()
            if why:
                logger.warning("%s", why)
            elif not _has_flag(self.config.extra_args, "--mem-fraction-static"):
                logger.info(
                    "SGLang takes ~%d%% of each GPU it uses (its automatic --mem-fraction-static);"
                    " if a trainer shares the GPU, pass `-- --mem-fraction-static 0.4` or similar",
                    int(SGLANG_AUTO_FRACTION * 100),
                )
        logger.info(
            "starting SGLang on %s (%s), log %s: %s", self.url, self.device, self.log_path, " ".join(shown_command(cmd))
        )
        env = self.environment()
        self._refuse_if_interrupted()  # the checks above can take long (nvidia-smi): a signal may have come
        taken = self.port_problem()
        if taken:
            raise SGLangStartError(f"SGLang was not started: {taken}; stop that process, or give serve another --port")
        rotate_log(self.log_path, LOG_ROTATE_BYTES)
        remove_key_file(self._key_file)
        cmd, self._key_file = key_off_command_line(cmd)  # not on a command line every user can read
        try:
            self._group = ProcessGroup(
                cmd,
                self.log_path,
                name="SGLang server",
                env=env,
                die_with_parent=self.config.die_with_parent,
                log_name=_setting_flag("log_path") if not self._temp_log else "SGLang's temporary log",
            )
            self._group.start()
        except BaseException:
            remove_key_file(self._key_file)
            self._key_file = None
            raise

    def _track_probe(self, probe: subprocess.Popen[bytes]) -> None:
        self._probe = probe
        if self._interrupted:  # the signal came as it was being started
            probe.kill()

    def _refuse_if_interrupted(self) -> None:
        if self._interrupted:
            raise SGLangStartError("SGLang was not started: its start was interrupted (serve is stopping)")

    def interrupt(self, sig: int = signal.SIGTERM) -> None:
        """End a `start()` or `wait_healthy()` under way: from a signal handler or another thread.

        A CUDA probe in flight is killed, nothing is launched from now on (until `stop()`), and a
        server already launched gets ``sig``, so that the wait for `/health` ends as it exits. Takes
        no lock and waits for nothing (the interrupted thread may hold any)."""
        self._interrupted = True
        probe = self._probe
        if probe is not None:
            try:
                probe.kill()
            except OSError:
                pass
        if self._group is not None:
            self._group.send_signal(sig)

    def is_running(self) -> bool:
        """True while the server's main process has not exited."""
        return self._group is not None and self._group.is_running()

    def port_problem(self) -> str | None:
        """``port P on HOST is in use by another process (pid ...)`` when a process that is not this
        server's holds SGLang's port now, so that SGLang cannot listen there; else None."""
        host, port = self.config.host, self.port
        if not port_in_use(host, port):
            return None
        ours: set[int] = set()
        if self._group is not None and self._group.is_running():
            if self._group.listens_on(port) is not False:
                return None  # this server holds it (or /proc cannot tell who does)
            ours = self._group.member_pids() or set()
        return f"port {port} on {host} is in use by another process ({describe_pids(port_listeners(port, ours))})"

    def wait_healthy(
        self,
        timeout_s: float = 300.0,
        *,
        progress_grace_s: float | None = None,
        timeout_hint: str = "a slow machine may need a larger timeout",
    ) -> None:
        """Block until GET /health answers 200.

        With `progress_grace_s`, the wait goes on past `timeout_s` for as long as the server log
        keeps growing (a first start that downloads the model, compiles kernels or captures CUDA
        graphs prints progress) and ends once the log has been silent for `progress_grace_s`, or at
        the latest `PROGRESS_CAP_FACTOR` (3) times `timeout_s` after it began.

        Only this server's answer counts: SGLang listens on its port only once its model is loaded,
        and another process that took the port meanwhile may answer ``/health`` too; its answers
        are not taken for SGLang's (`ProcessGroup.wait_http`'s ``listen_port``), and the error then
        says that the port was taken and by whom.

        Raises:
            SGLangStartError: the process exited first (with its exit code) or the time ran out;
                the message holds the last lines of the server log and `timeout_hint`.
        """
        if self._group is None:
            raise RuntimeError("wait_healthy() called before start()")
        try:
            self._group.wait_http(
                f"{self.url}/health",
                timeout_s,
                progress_grace_s=progress_grace_s,
                timeout_hint=timeout_hint,
                listen_port=self.port,
                stopped=lambda: self._interrupted,  # (an SGLang that ignores the signal is not waited for)
            )
        except ProcessStartError as exc:
            self._keep_log = self._keep_log or not self._interrupted  # the message names the log
            raise SGLangStartError(self._taken_note() + str(exc)) from None
        # SGLang read its key when it parsed its arguments: the file goes now, not at stop (a
        # `serve` killed with SIGKILL would leave it behind)
        remove_key_file(self._key_file)
        self._key_file = None

    def _taken_note(self) -> str:
        """What a failed wait's message starts with when SGLang's port was taken by another process
        (it answered in SGLang's place, or holds the port now); "" otherwise."""
        if self._interrupted or self._group is None:
            return ""
        stranger = self._group.stranger
        if stranger is not None:
            return (
                f"port {self.port} on {self.config.host} was taken by another process ({stranger}), which"
                " answered /health in SGLang's place; its answers were not taken for SGLang's: "
            )
        try:
            problem = self.port_problem()
        except OSError:
            return ""
        return f"{problem}, taken while SGLang started, so SGLang could not listen there: " if problem else ""

    def stop(self, timeout_s: float = 20.0) -> None:
        """Terminate the whole process group: SIGTERM, then SIGKILL after `timeout_s`.

        Safe to call more than once, and also when the main process already died (its
        children are still killed through the process group). A temporary log (no `log_path`
        given) is removed, unless SGLang failed (exited by itself, or did not become healthy):
        then it stays for the errors that quote it, and where it is is logged.
        """
        if self._group is not None:
            if self._group.returncode is not None and not self._interrupted:  # it exited by itself
                self._keep_log = True
            self._group.stop(timeout_s)
        self._interrupted = False
        self._probe = None
        remove_key_file(self._key_file)
        self._key_file = None
        if self._temp_log:
            self._remove_temp_log()

    def _remove_temp_log(self) -> None:
        if self._keep_log:
            if self.log_path.exists() and self._said_kept != self.log_path:
                self._said_kept = self.log_path
                logger.warning(
                    "SGLang failed; its log is kept at %s (a temporary file: delete it when done)", self.log_path
                )
            return
        for path in (self.log_path, Path(f"{self.log_path}.1")):  # .1: the part `rotate_log` moved
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                logger.warning("could not remove SGLang's temporary log %s: %s", path, exc.strerror or exc)

    def restart(self, timeout_s: float, **wait_kwargs: Any) -> None:
        """Stop the server (if running), start it again on the same port and wait healthy.

        `timeout_s` and `wait_kwargs` go to `wait_healthy`; there is no default, so that a caller
        (a supervisor) always passes its own start-up timeout.
        """
        self.stop()
        self.start()
        self.wait_healthy(timeout_s, **wait_kwargs)

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        """The last `n` lines of the server log ("" when there is no log yet)."""
        return log_tail(self.log_path, n)

    def __enter__(self) -> SGLangServer:
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
