"""Helpers for sidecar tests: a sidecar (or `serve`) subprocess, and perturbed checkpoints."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from helpers import free_port
from rollout_service.process_group import ProcessGroup, ProcessStartError
from rollout_service.sidecar.sglang_client import ServerView

START_TIMEOUT_S = 60.0


class CLIProcess:
    """A `rollout-service ...` subprocess in its own process group, with its log in a file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.args = args
        self.log_path = log_path
        self.group = ProcessGroup(
            [sys.executable, "-m", "rollout_service.cli", *args],
            log_path,
            name=f"rollout-service {args[0]}",
            env={**os.environ, **(env or {})},
            die_with_parent=True,
        )
        self.group.start()

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.group.process is not None
        return self.group.process

    def log_tail(self, n: int = 60) -> str:
        return self.group.log_tail(n)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the whole process group; SIGKILL what is left after 30 s."""
        self.group.stop(30.0, sig)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


class Sidecar(CLIProcess):
    """`rollout-service sidecar` against an SGLang URL."""

    def __init__(
        self, root: Path, sglang_url: str, log_path: Path, *extra: str, replica_id: str = "r0", port: int | None = None
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stage_dir: Path | None = None
        """The stage this helper chose (None when the test chose one, or none)."""
        if "--stage-dir" not in extra and "--no-stage" not in extra:
            # Each test's own stage (the default, /dev/shm/rollout-stage-REPLICA, is per machine).
            self.stage_dir = log_path.parent / f"stage-{replica_id}-{self.port}"
            extra = ("--stage-dir", str(self.stage_dir), *extra)
        super().__init__(
            [
                "sidecar",
                "--checkpoint-path",
                str(root),
                "--sglang-url",
                sglang_url,
                "--port",
                str(self.port),
                "--replica-id",
                replica_id,
                "--health-interval",
                "0.5",
                *extra,
            ],
            log_path,
        )
        wait_http(f"{self.url}/healthz", START_TIMEOUT_S, self)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=kw.pop("timeout", 30), **kw)

    def status(self) -> dict:
        return self.get("/status").json()

    def wait_step(self, step: int, timeout_s: float = 120.0) -> dict:
        r = self.get(f"/wait?version={step}&timeout={timeout_s}", timeout=timeout_s + 30)
        assert r.status_code == 200, f"step {step} not loaded: {r.text}\n--- log ---\n{self.log_tail()}"
        return r.json()

    def wait_stage_bytes(self, timeout_s: float = 30.0) -> int:
        """The stage's bytes once /status reports them: measured after a load is answered and
        the stage pruned, so the stage then holds its steady state."""
        deadline = time.monotonic() + timeout_s
        while (held := self.status()["stage_bytes"]) is None:
            assert time.monotonic() < deadline, f"/status never reported the stage's bytes\n{self.log_tail()}"
            time.sleep(0.1)
        return held

    def metric(self, name: str, **labels: str) -> float:
        """One sample's value from /metrics (0.0 when absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(self.get("/metrics").text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
        return 0.0


def serve_argv(
    model_dir: Path,
    root: Path,
    port: int,
    sidecar_port: int,
    replica_id: str,
    *extra: str,
    health_interval: str | None = "0.5",
) -> list[str]:
    """``rollout-service serve`` on the CPU with a fast health loop (the tests' common flags;
    ``health_interval=None``: serve's own)."""
    health = [] if health_interval is None else ["--health-interval", health_interval]
    return [
        "serve",
        "--model",
        str(model_dir),
        "--checkpoint-path",
        str(root),
        "--port",
        str(port),
        "--sidecar-port",
        str(sidecar_port),
        "--device",
        "cpu",
        *health,
        "--replica-id",
        replica_id,
        *extra,
    ]


def wait_http(url: str, timeout_s: float, proc: CLIProcess, status: int = 200) -> None:
    """Wait until GET `url` answers `status`; fail the test naming `proc`'s exit or log tail otherwise."""
    try:
        proc.group.wait_http(url, timeout_s, status=status)
    except ProcessStartError as exc:
        raise AssertionError(str(exc)) from None


def perturbed_state(model_dir: Path, step: int, scale: float = 0.05) -> dict:
    """The model's tensors plus step-seeded noise: each step has distinct, known weights."""
    import torch
    from safetensors.torch import load_file

    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    g = torch.Generator().manual_seed(1000 + step)
    return {
        k: (v + scale * torch.randn(v.shape, generator=g).to(v.dtype)) if v.is_floating_point() else v
        for k, v in state.items()
    }


def publish_step(root: Path, model_dir: Path, step: int, state: dict | None = None):
    from rollout_service.checkpoint_writer import publish_checkpoint

    state = perturbed_state(model_dir, step) if state is None else state
    return publish_checkpoint(root, step, state.items(), config=model_dir / "config.json", base_model=str(model_dir))


def transformers_greedy(model_dir: Path, state: dict, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers with ``state`` loaded over the model's weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def transformers_logprobs(model_dir: Path, state: dict, prompt: list[int], completion: list[int]) -> list[float]:
    """The logprob transformers gives each token of ``completion`` after ``prompt``, with ``state``
    loaded over the model's weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    model.eval()
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[len(prompt) - 1 + i, tok].item() for i, tok in enumerate(completion)]


def run_loop_until(controller: Any, done: Any, timeout_s: float = 10.0) -> None:
    """Run the sidecar's loop in this process until ``done()`` (or ``timeout_s``), then stop it."""

    async def scenario() -> None:
        controller._stopping = False
        loop = asyncio.create_task(controller.run())
        loop.add_done_callback(controller.loop_ended)
        try:
            for _ in range(int(timeout_s / 0.05)):
                if done():
                    break
                await asyncio.sleep(0.05)
        finally:
            await controller.stop()
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await loop

    asyncio.run(scenario())


class AcceptingSGLang:
    """A fake SGLang client as the sync loop sees it: healthy, serving ``model_path``, every load
    accepted (for tests of what the sidecar does around a load, not of SGLang's load itself)."""

    def __init__(self, model_path: Path):
        self.version: str | None = None
        self.model_path = str(model_path)
        self.loads: list[str] = []

    async def view(self, deep: bool = False) -> ServerView:
        return ServerView(True, self.version, self.model_path)

    async def load_from_disk(self, path: str, version: str) -> dict:
        self.loads.append(path)
        self.version, self.model_path = version, path
        return {}

    async def aclose(self) -> None:
        pass


@contextlib.contextmanager
def uvicorn_served(app: Any, settings_: Any) -> Iterator[int]:
    """The sidecar's ``app`` under uvicorn as ``sidecar`` runs it (its config from ``settings_``),
    on a free port of 127.0.0.1, in a thread; yields the port."""
    import dataclasses
    import threading

    import uvicorn

    from rollout_service.sidecar.app import uvicorn_config

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, dataclasses.replace(settings_, port=port)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def assert_load_interval_inside_sync(last: dict) -> None:
    """``load_started_at``/``load_ended_at`` (the /update_weights_from_disk call, this host's
    clock) lie after the step was seen and validated and before the sync ended, and span load_s."""
    start, end = last["load_started_at"], last["load_ended_at"]
    assert abs((end - start) - last["load_s"]) < 1e-6, last
    published = last["finished_at"] - last["total_s"]
    assert published + last["detect_s"] + last["validate_s"] <= start + 0.005, last
    assert start < end <= last["finished_at"], last
