"""End-to-end weight sync, phase by phase, against the physical limit and the naive TRL path.

    ./scripts/run.sh python benchmarks/sync_bench.py [--sizes tiny,0.5,1,2] [--storage local,shm]
        [--repeats 3] [--device cpu|cuda] [--skip-naive] [--json OUT] [--quick]

For each model size it builds (or reuses) a random-weight Qwen2 model of about that many GB in
bfloat16 (``tiny`` is the project's tiny float32 model; see ``model_factory.py``), loads it as
the trainer's copy with transformers and starts one real SGLang server on it (``--dtype``
bfloat16 for bf16 models). Then, for each storage directory, with a fresh checkpoint root each,
it measures three ways of getting the trainer's weights into SGLang:

* ``physical limit``: the same bytes written raw to one file + fsync, then read back, once right
  after the write (page cache hot, as SGLang reads a checkpoint just written on the same node)
  and once cold (``drop_caches`` when writable, else ``posix_fadvise(DONTNEED)``; tmpfs has no
  cold read), each read both with ``read()`` into a buffer and through a memory map copied page
  by page into a tensor (as safetensors hands SGLang its weights), the faster counting
  (``measures.py``). ``limit`` = write+fsync + hot read; ``limit-cold`` = write+fsync + cold read.
* ``naive``: the path of the original TRL pull request: ``model.save_pretrained(fixed_dir)``
  (no fsync, overwritten every step) and the trainer calling ``/update_weights_from_disk``
  itself; both times.
* ``ours``: ``publish_checkpoint`` of the model's state dict into the root, and a sidecar
  subprocess (inotify) that detects, validates and loads it into SGLang; phases from the
  sidecar's ``/wait`` answer (its ``last_sync``): detection (step directory renamed into place
  -> sidecar woken), validation, SGLang load, acknowledgement (load done -> the trainer's
  ``/wait`` returned); end to end = publish start -> the trainer knows the step is served.
* ``ours_nostage`` (without ``--delta``): the same with ``--no-stage`` (SGLang reads the root).
* ``ours_delta`` (``--delta``): the trainer's fp32 master copy stepped by AdamW with random
  gradients at ``--delta-lr`` between versions (realistic update sizes; ``--adam-warmup`` steps
  first, as ``delta_bench.py``), published in bf16 as deltas (``DeltaCheckpointWriter``), rebuilt
  and verified in the sidecar's stage, loaded from there. ``ours`` then is today's full path on
  the same storage and server, publishing the same trainer's weights: both cast the fp32 master
  copy to bf16 inside the timed sync (``--delta-from master``), or both get bf16 copies cast
  before it (``--delta-from bf16``). ``delta_limit``: the delta path's physical limit, measured
  after each delta run: its bytes written + fsync + read back, one write of the model over
  existing pages in the stage's file system, and that run's SGLang load.

Physical and naive runs alternate per repeat; the sidecar runs come after them (a naive load
would make a running sidecar re-apply its own checkpoint). Then the sidecar paths alternate run
by run (ours, ours_delta, ours, ours_delta, ...; one SGLang server), each run with its own
fresh root, stage and sidecar, ``--warmup`` untimed syncs (default 2: the first stages the
served copy, the second leaves the copy before it as the stage's spare, so that every path's
timed sync writes over a spare, as in steady state; first-call costs are not a sync's) and one
timed sync; ``--repeats`` runs per path (default 3), medians.

Before each timed sync the probe times one-token ``/generate`` requests for ``--idle-probe-s``
seconds with nothing else running: their median is the idle baseline. During the timed sync a
probe thread sends them back to back; the longest probe that overlapped the sync less that
baseline is SGLang's ``pause``, from the publish's rename on ``replica_pause``, over the
load's own interval as the sidecar recorded it (``last_sync``'s ``load_started_at`` and
``load_ended_at``) ``load_pause`` (``load_pause_sent``: only probes sent during it; with
``load_probe_overlap_s``, the seconds of that interval probes were in flight, and
``load_probe_spans``, the probes near it, in seconds from its start). Probes flow before the
sync starts, and the figures are read once the last probe is answered. Right
after the timed sync, SGLang loads the copy it now serves once more through a bare
``/update_weights_from_disk`` call, with the probe and nothing else running: ``bare_load_s`` and
``bare_pause_s`` are SGLang's own floor, which the sync's pause over its load is read against.
On a CPU test bed that probe keeps SGLang computing on the cores the sidecar and the trainer
use; ``--no-probe`` measures end to end with SGLang idle (as where it generates on a GPU).

Prints medians, the ratios ours/limit, ours/naive, delta/full, delta/limit and pause/load, and
writes every run as JSON (``--json``, rewritten after each size). ``--no-sglang`` measures only
the trainer side (publish, raw write, save_pretrained), for machines where SGLang cannot run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import measures  # noqa: E402
from model_factory import ensure_bench_model  # noqa: E402

from rollout_service.checkpoint_writer import iter_unique_tensors, publish_checkpoint  # noqa: E402
from rollout_service.sglang_launcher import SGLangServer  # noqa: E402
from rollout_service.sidecar.staging import SPARE_PREFIX  # noqa: E402
from rollout_service.tiny_model import ensure_tiny_model  # noqa: E402

STORAGE_ALIASES = {"local": REPO / "benchmarks" / "results" / "sync-bench-work", "shm": Path("/dev/shm")}
MEMORY_FILESYSTEMS = {"tmpfs", "ramfs"}


@dataclass
class Case:
    """One (model size, storage) measurement and its runs."""

    size: str
    storage: str
    path: str
    fs_type: str
    cold_read: str
    sglang: bool
    model_bytes: int = 0
    tensors: int = 0
    physical: list[dict[str, float]] = field(default_factory=list)
    naive: list[dict[str, float]] = field(default_factory=list)
    ours: list[dict[str, float]] = field(default_factory=list)
    ours_nostage: list[dict[str, float]] = field(default_factory=list)
    ours_delta: list[dict[str, float]] = field(default_factory=list)
    delta_limit: list[dict[str, float]] = field(default_factory=list)
    error: str | None = None

    KINDS = ("physical", "naive", "ours", "ours_nostage", "ours_delta", "delta_limit")

    def medians(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for kind in self.KINDS:
            runs = getattr(self, kind)
            for key in runs[0] if runs else {}:
                values = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]
                if values:
                    out[f"{kind}.{key}"] = statistics.median(values)
        return out

    def ratios(self) -> dict[str, float]:
        med = self.medians()
        ours = med.get("ours.end_to_end_s")
        out = {}
        # Without SGLang nothing is read back: the limit is the write alone.
        limits = (
            (("ours/limit", "physical.limit_s"), ("ours/limit-cold", "physical.limit_cold_s"))
            if self.sglang
            else (("ours/limit", "physical.write_fsync_s"),)
        )
        for name, key in (*limits, ("ours/naive", "naive.total_s"), ("ours/ours_nostage", "ours_nostage.end_to_end_s")):
            if ours is not None and med.get(key):
                out[name] = ours / med[key]
        delta = med.get("ours_delta.end_to_end_s")
        if delta is not None:
            for name, key in (
                ("delta/full", "ours.end_to_end_s"),
                ("delta/limit", "physical.limit_s"),
                ("delta/limit-delta", "delta_limit.limit_with_load_s"),
            ):
                if med.get(key):
                    out[name] = delta / med[key]
        # SGLang's pause against its own load from the stage, per path: the whole sync's, the
        # replica's part (from the publish's rename on), over the recorded load interval (every
        # probe in flight then, or only those sent then), and a bare load's (SGLang's floor).
        for kind, label in (("ours", "full"), ("ours_delta", "delta")):
            for name, value_key, load_key in (
                ("pause/load", "pause_s", "load_s"),
                ("replica_pause/load", "replica_pause_s", "load_s"),
                ("load_pause/load", "load_pause_s", "load_s"),
                ("load_pause_sent/load", "load_pause_sent_s", "load_s"),
                ("bare_pause/load", "bare_pause_s", "bare_load_s"),
                ("bare_pause_sent/load", "bare_pause_sent_s", "bare_load_s"),
            ):
                value, base = med.get(f"{kind}.{value_key}"), med.get(f"{kind}.{load_key}")
                if value is not None and base:
                    out[f"{label} {name}"] = value / base
        return out


# --- storage and the physical limit ---------------------------------------------------------


def fs_type(path: Path) -> str:
    """File-system type of the mount holding ``path`` (from /proc/mounts; "unknown" if unreadable)."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mount = parts[1].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, parts[2]
    except OSError:
        pass
    return kind


def choose_cold_read(path: Path, wanted: str) -> str:
    """How this storage's cold read empties the page cache: drop_caches, fadvise or none."""
    if fs_type(path) in MEMORY_FILESYSTEMS:
        return "none (tmpfs: the files are the memory)"
    if wanted in ("auto", "drop_caches"):
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "drop_caches"
        except OSError as exc:
            if wanted == "drop_caches":
                raise RuntimeError(
                    f"cannot write /proc/sys/vm/drop_caches ({exc}); run as root or pass --cold-read fadvise"
                ) from exc
    return "fadvise"


def evict(path: Path, method: str) -> None:
    if method == "drop_caches":
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    elif method == "fadvise":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def physical_limit(work: Path, tensors: Iterable[torch.Tensor], cold_read: str) -> dict[str, float]:
    """Raw write + fsync of the tensors' bytes, then a hot and a cold read of them, each both
    ways (``read()`` into a buffer, and a mapping copied page by page into a tensor, as
    safetensors hands SGLang its weights); the faster way counts, so that the limit stays a
    lower bound whichever way a reader reads (only the writes and the fsync are timed:
    ``tensors`` may be made one by one as they are written)."""
    path = work / "raw.bin"
    try:
        write_s = measures.write_fsync(path, tensors=tensors)
        hot = measures.read_back(path)
        evict(path, cold_read)
        cold_mmap_s = measures.read_mmap(path)
        evict(path, cold_read)
        cold_copy_s = measures.read_copy(path)
    finally:
        path.unlink(missing_ok=True)
    read_cold_s = min(cold_mmap_s, cold_copy_s)
    return {
        "write_fsync_s": write_s,
        "read_hot_s": hot["read_s"],
        "read_hot_copy_s": hot["read_copy_s"],
        "read_hot_mmap_s": hot["read_mmap_s"],
        "read_cold_s": read_cold_s,
        "read_cold_copy_s": cold_copy_s,
        "read_cold_mmap_s": cold_mmap_s,
        "limit_s": write_s + hot["read_s"],
        "limit_cold_s": write_s + read_cold_s,
    }


# --- the naive path and ours -----------------------------------------------------------------


def load_into_sglang(url: str, path: Path, version: str, timeout_s: float) -> None:
    r = httpx.post(
        f"{url}/update_weights_from_disk",
        json={"model_path": str(path), "weight_version": version, "flush_cache": True},
        timeout=timeout_s,
    )
    data = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code != 200 or not data.get("success", False):
        raise RuntimeError(f"SGLang refused {path} (HTTP {r.status_code}): {r.text[:500]}")


def naive_sync(trainer: Any, fixed: Path, url: str | None, version: str, timeout_s: float) -> dict[str, float]:
    """save_pretrained into one fixed folder, then the trainer asks SGLang to load it."""
    t0 = time.perf_counter()
    trainer.save_pretrained(fixed)
    save_s = time.perf_counter() - t0
    if url is None:
        return {"save_s": save_s, "total_s": save_s}
    t1 = time.perf_counter()
    load_into_sglang(url, fixed, version, timeout_s)
    load_s = time.perf_counter() - t1
    return {"save_s": save_s, "load_s": load_s, "total_s": save_s + load_s}


def wait_served(sidecar: Any, step: int, timeout_s: float) -> dict[str, Any]:
    r = sidecar.get(f"/wait?version={step}&timeout={timeout_s}", timeout=timeout_s + 30)
    if r.status_code != 200:
        raise RuntimeError(
            f"step {step} was not served within {timeout_s:.0f} s: {r.text[:500]}\n"
            f"--- sidecar log ---\n{sidecar.log_tail()}"
        )
    return r.json()


PROBE_REQUEST = {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


def idle_probes(url: str, seconds: float) -> list[float]:
    """One-token ``/generate`` probes sent back to back for ``seconds`` with nothing else running
    (between syncs, after the trainer's step): their durations, the pause's baseline."""
    durations: list[float] = []
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=900) as client:
        client.post(f"{url}/generate", json=PROBE_REQUEST)  # a fresh connection is not a probe's cost
        while time.monotonic() < deadline or len(durations) < 3:
            t0 = time.perf_counter()
            client.post(f"{url}/generate", json=PROBE_REQUEST)
            durations.append(time.perf_counter() - t0)
    return durations


class Probe:
    """Sends one-token ``/generate`` requests back to back during one sync and remembers when
    each ran; ``idle`` is the median probe timed just before, with nothing else running."""

    def __init__(self, url: str, idle: list[float]) -> None:
        import threading

        self.url = url
        self.idle_durations = idle
        self.idle = measures.idle_baseline(idle)
        self.spans: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pause-probe", daemon=True)

    def __enter__(self) -> Probe:
        """Starts the probes and returns once they flow (the thread's start and its client's
        first connection are no part of what a sync is measured against)."""
        self._thread.start()
        if not self._ready.wait(timeout=120):
            self._stop.set()
            raise RuntimeError(f"the pause probe got no answer from {self.url}/generate within 120 s")
        if self._failed is not None:
            raise RuntimeError(f"the pause probe's first /generate failed: {self._failed!r}") from self._failed
        return self

    def __exit__(self, *exc: Any) -> None:
        """Stops sending and waits for the probe in flight: its span is recorded before any
        figure is read (the probe a load held back ends after the load, often after the
        trainer's wait returned)."""
        self._stop.set()
        self._thread.join(timeout=600)

    def _run(self) -> None:
        with httpx.Client(timeout=900) as client:
            try:
                client.post(f"{self.url}/generate", json=PROBE_REQUEST)  # a fresh connection is not a probe's cost
            except Exception as exc:  # told by __enter__, not lost with the thread
                self._failed = exc
                return
            finally:
                self._ready.set()
            while not self._stop.is_set():
                t0 = time.time()
                try:
                    client.post(f"{self.url}/generate", json=PROBE_REQUEST)
                except httpx.HTTPError:
                    pass
                self.spans.append((t0, time.time()))

    def pause(self, start: float, end: float) -> float | None:
        """Longest probe overlapping [start, end], less the idle baseline."""
        return measures.pause_over(self.spans, start, end, self.idle)

    def pause_sent(self, start: float, end: float) -> float | None:
        """Longest probe sent during [start, end], less the idle baseline."""
        return measures.pause_started_in(self.spans, start, end, self.idle)

    def figures(self, t0: float, published: float, load_start: float, load_end: float, acked: float) -> dict:
        """The sync's pause figures: the whole sync's (publish start -> acknowledged), the
        replica's part (from the publish's rename on: what SGLang feels where the trainer runs on
        other hosts; here the trainer's encode and write share SGLang's cores), and over the
        sidecar's recorded load interval, with how long probes were in flight during it. Read
        once the probe has stopped (after ``with``): every probe sent before ``acked`` is in."""
        if self._thread.is_alive():
            raise RuntimeError("the probe's figures are read once it has stopped (after its with block)")
        return {
            "idle_probe_s": self.idle,
            "idle_probes": len(self.idle_durations),
            "probes": sum(1 for a, b in self.spans if a < acked and b > t0),
            "pause_s": self.pause(t0, acked),
            "replica_pause_s": self.pause(published, acked),
            "load_pause_s": self.pause(load_start, load_end),
            "load_pause_sent_s": self.pause_sent(load_start, load_end),
            "load_probe_overlap_s": measures.overlap_seconds(self.spans, load_start, load_end),
            "load_probe_spans": measures.spans_near(self.spans, load_start, load_end),
        }


def our_sync(
    root: Path,
    step: int,
    state: dict[str, torch.Tensor],
    config: Path,
    sidecar: Any | None,
    timeout_s: float,
    delta: Any | None = None,
    dtype: str | None = None,
) -> dict[str, Any]:
    """Publish (in full, or as a delta with ``delta``), then wait until the sidecar serves it;
    ``dtype`` casts a full publish's tensors (a delta is always published in bf16). With a
    sidecar, ``window`` holds the times a probe's figures are read over (:meth:`Probe.figures`)."""
    t0 = time.time()
    if delta is not None:
        result = delta.publish(
            root, step, state.items(), config=json.loads(config.read_text()), dtype="bfloat16", run_id="bench"
        )
        out = {
            "publish_s": time.time() - t0,
            "publish_write_s": delta.last.write_s,
            "encode_s": delta.last.encode_s,
            "bytes_written": result.total_bytes,
            "full_bytes": result.full_bytes,
            "changed_fraction_tensors": delta.last.changed_tensors / max(delta.last.tensors, 1),
            "delta": result.kind == "delta",
        }
    else:
        result = publish_checkpoint(root, step, state.items(), config=config, dtype=dtype, run_id="bench")
        out = {
            "publish_s": result.total_seconds,
            "publish_write_s": result.write_seconds,
            "bytes_written": result.total_bytes,
            "full_bytes": result.total_bytes,
        }
    if sidecar is None:
        out["end_to_end_s"] = result.total_seconds
        return out
    body = wait_served(sidecar, step, timeout_s)
    acked = time.time()
    last = body.get("last_sync") or {}
    if last.get("step") != step or last.get("total_s") is None:
        raise RuntimeError(f"the sidecar's last_sync is not step {step}'s first load: {last}")
    published = last["finished_at"] - last["total_s"]
    load_start, load_end = last["load_started_at"], last["load_ended_at"]  # the load's own interval
    out.update(
        detect_s=last["detect_s"],
        validate_s=last["validate_s"],
        load_s=last["load_s"],
        ack_s=acked - load_end,
        sidecar_total_s=last["total_s"],
        end_to_end_s=acked - t0,
        apply_s=last.get("apply_s"),
        bytes_read=last.get("bytes_read"),
    )
    out["window"] = (t0, published, load_start, load_end, acked)
    return out


# --- one size, one storage -------------------------------------------------------------------


def run_case(
    case: Case,
    work: Path,
    args: argparse.Namespace,
    trainer: Any,
    state: dict[str, torch.Tensor] | None,
    cpu_state: dict[str, torch.Tensor] | None,
    config: Path,
    server: SGLangServer | None,
    log_dir: Path,
    master: dict[str, torch.nn.Parameter] | None = None,
) -> None:
    """``master``: with ``--delta``, the trainer's fp32 weights, which both kinds publish (with
    ``--skip-naive`` on the CPU, ``trainer``, ``state`` and ``cpu_state`` are then None: see
    :func:`_run_all`)."""
    url = server.url if server is not None else None
    fixed = work / "naive-fixed"
    if not args.skip_naive:
        for w in range(args.warmup):  # first-call costs (imports, allocations) are not a sync's
            naive_sync(trainer, fixed, url, f"naive-warmup-{w}", args.sync_timeout)
    for rep in range(args.repeats):
        order = ["physical", "naive"] if rep % 2 == 0 else ["naive", "physical"]
        for kind in order:
            if kind == "physical":
                if cpu_state is not None:
                    tensors: Iterable[torch.Tensor] = cpu_state.values()
                else:  # dropped for the master weights (see _run_all): cast one by one
                    assert master is not None
                    tensors = (p.detach().to(torch.bfloat16) for p in master.values())
                case.physical.append(physical_limit(work, tensors, case.cold_read))
            elif not args.skip_naive:
                case.naive.append(naive_sync(trainer, fixed, url, f"naive-{rep}", args.sync_timeout))
        progress(
            f"  repeat {rep + 1}: limit {case.physical[-1]['limit_s']:.3f} s"
            + (f", naive {case.naive[-1]['total_s']:.3f} s" if case.naive else "")
        )
    shutil.rmtree(fixed, ignore_errors=True)

    # ours: the default sidecar (each checkpoint copied into the node-local stage and every byte
    # verified before SGLang reads the copy); ours_nostage: SGLang reads the root directly
    # (headers-only validation; the time-of-check/time-of-use window open); ours_delta (--delta):
    # deltas rebuilt in the stage, beside ours. Same process, same server, one run of each path
    # after the other (A, B, A, B, ...), each run its own sidecar, root and stage with the same
    # warm-up: their ratio is what the difference costs.
    kinds = ["ours", "ours_delta"] if args.delta else ["ours", "ours_nostage"]
    if server is None:
        kinds = ["ours"]  # without SGLang nothing is staged or loaded: the trainer side only
    stepper = None
    if master is not None and args.delta:
        stepper = AdamStepper(master, args.delta_lr)
        for _ in range(args.adam_warmup):  # Adam's first steps move every weight by lr: not the steady state
            stepper.step()
    try:
        for rep in range(args.repeats):
            for kind in kinds:
                run, stage = sidecar_run(kind, rep, case, work, args, state, config, server, log_dir, master, stepper)
                getattr(case, kind).append(run)
                line = f"  repeat {rep + 1}: {kind} {run['end_to_end_s']:.3f} s"
                if run.get("pause_s") is not None:
                    line += f" (pause {run['pause_s']:.3f} s, load {run['load_s']:.3f} s)"
                if kind == "ours_delta":
                    # The delta path's physical limit, with this run's delta bytes and SGLang's load.
                    limit = measures.delta_limit(work, run["bytes_written"], stage.parent, case.model_bytes)
                    limit["limit_with_load_s"] = limit["limit_s"] + run["load_s"]
                    case.delta_limit.append(limit)
                    line += f"; its limit {limit['limit_with_load_s']:.3f} s"
                progress(line)
    finally:
        if stepper is not None:
            stepper.close()


class AdamStepper:
    """The trainer's AdamW over its fp32 master weights, stepped with random gradients (Adam's
    step does not depend on the gradient's scale, so update sizes are realistic), one parameter
    at a time: one gradient in memory, not a model's (see ``delta_bench.adam_step``)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], lr: float) -> None:
        self.params = params
        self.opt: torch.optim.Optimizer | None = torch.optim.AdamW(params.values(), lr=lr)
        device = next(iter(params.values())).device
        self.gen = torch.Generator(device=device).manual_seed(1)

    def step(self) -> None:
        assert self.opt is not None
        for p in self.params.values():
            p.grad = torch.randn(p.shape, generator=self.gen, device=p.device)
            self.opt.step()
            p.grad = None
        if next(iter(self.params.values())).is_cuda:
            torch.cuda.synchronize()

    def close(self) -> None:
        """Drop AdamW's two states (two fp32 copies of the model)."""
        self.opt = None
        gc.collect()


def warmup_syncs(args: argparse.Namespace) -> int:
    """Untimed syncs before each run's timed one: ``--warmup``, and with ``--delta`` at least one
    (a delta chain starts with a full version); the same number for every path."""
    return max(args.warmup, 1) if args.delta else args.warmup


def sidecar_run(
    kind: str,
    rep: int,
    case: Case,
    work: Path,
    args: argparse.Namespace,
    state: dict[str, torch.Tensor] | None,
    config: Path,
    server: SGLangServer | None,
    log_dir: Path,
    master: dict[str, torch.nn.Parameter] | None,
    stepper: AdamStepper | None,
) -> tuple[dict[str, Any], Path]:
    """One run of one path: a fresh root, stage and sidecar, :func:`warmup_syncs` untimed syncs
    (with the default 2 the first stages the served copy and the second leaves the copy before
    it as the stage's spare, so that the timed sync writes over a spare, as in steady state),
    then one timed sync, with the probe when asked. Returns the timed sync's figures and the
    run's stage folder (removed by then; the delta limit writes beside it, in its file system)."""
    from sidecar_helpers import Sidecar

    root = work / f"ckpt-{kind}-{rep}"
    root.mkdir()
    stage = stage_dir_for(args, work, f"{kind}-{rep}")
    flags = ("--no-stage",) if kind == "ours_nostage" else ("--stage-dir", str(stage))
    sidecar = None
    writer = None
    if server is not None:
        sidecar = Sidecar(
            root,
            server.url,
            log_dir / f"sidecar-{kind}-{case.size}-{Path(case.path).name}-{rep}.log",
            "--deep-health-interval",
            "3600",
            *flags,
            # the naive runs left SGLang on a deleted folder: name the model
            "--reference-dir",
            str(config.parent),
            replica_id=f"bench-{kind}-{rep}",
        )
    try:
        if sidecar is not None:
            deadline = time.monotonic() + 120
            while not (sidecar.status().get("sglang_healthy") and sidecar.status().get("reference")):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the sidecar never saw SGLang healthy:\n{sidecar.log_tail()}")
                time.sleep(0.2)
        trainer_state, dtype = state, None
        if master is not None:
            # Both kinds publish the same trainer's weights (see --delta-from): fp32 master
            # weights, cast to bf16 by the publisher, or bf16 copies the trainer cast itself.
            trainer_state, dtype = master, "bfloat16"
        assert trainer_state is not None
        if kind == "ours_delta":
            from rollout_service.delta_writer import DeltaCheckpointWriter

            writer = DeltaCheckpointWriter(full_every=1000)
        warm = warmup_syncs(args)
        for i in range(warm + 1):
            step, timed = i + 1, i == warm
            if stepper is not None and step > 1:  # every path's versions move as the trainer's do
                stepper.step()
            handed = trainer_state
            if args.delta and args.delta_from == "bf16":  # the trainer's own cast, before the sync
                handed = {k: p.detach().to(torch.bfloat16) for k, p in trainer_state.items()}
            probe = None
            spare = None
            if timed:
                time.sleep(0.5)  # the sidecar's housekeeping after the last sync is done
                if server is not None and not args.no_probe:
                    probe = Probe(server.url, idle_probes(server.url, args.idle_probe_s))
                if kind != "ours_nostage" and server is not None:
                    spare = any(p.name.startswith(SPARE_PREFIX) for p in stage.iterdir()) if stage.is_dir() else False
            with probe if probe is not None else contextlib.nullcontext():
                run = our_sync(root, step, handed, config, sidecar, args.sync_timeout, delta=writer, dtype=dtype)
            window = run.pop("window", None)
            if probe is not None and window is not None:
                run.update(probe.figures(*window))
            del handed
            # Served (or, without SGLang, never read): keep only the newest step on the storage
            # (deltas: the whole chain, a late joiner needs it).
            if kind != "ours_delta":
                for old in root.glob("step-*"):
                    if old.name != f"step-{step:08d}" and old.is_dir():
                        shutil.rmtree(old)
            time.sleep(0.2)
        run.update(run=rep, warmup_syncs=warm, stage_spare=spare)
        if server is not None and sidecar is not None and not args.no_probe and kind != "ours_nostage":
            run.update(bare_load(server.url, sidecar, args))
        if kind == "ours_delta" and not run.get("delta"):
            raise RuntimeError(f"the timed delta run published in full: {writer.last if writer else None}")
        return run, stage
    finally:
        if writer is not None:
            writer.close()
        if sidecar is not None:
            sidecar.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(stage, ignore_errors=True)  # the run's own stage (in /dev/shm: memory)


def bare_load(url: str, sidecar: Any, args: argparse.Namespace) -> dict[str, float | None]:
    """SGLang's own pause floor: the copy it serves, loaded again by a bare
    ``/update_weights_from_disk`` call (same path, same weight version: nothing changes for the
    sidecar) with the probe running and nothing else to do: no rebuild, no trainer. The timed
    sync's pause over its load is read against this."""
    last = sidecar.status()["last_sync"]  # the timed sync's
    time.sleep(0.5)  # the sidecar's housekeeping after the timed sync is done
    probe = Probe(url, idle_probes(url, args.idle_probe_s))
    with probe:
        time.sleep(0.3)  # probes running before the load starts, as during a sync
        start = time.time()
        load_into_sglang(url, Path(last["path"]), last["weight_version"], args.sync_timeout)
        end = time.time()
        time.sleep(0.3)
    return {
        "bare_load_s": end - start,
        "bare_pause_s": probe.pause(start, end),
        "bare_pause_sent_s": probe.pause_sent(start, end),
        "bare_probe_spans": measures.spans_near(probe.spans, start, end),
        "bare_idle_probe_s": probe.idle,
    }


def stage_dir_for(args: argparse.Namespace, work: Path, run: str) -> Path:
    """One run's stage: a fresh folder under --stage-dir, else the sidecar's own default choice
    for a replica of its own (each run starts from an empty stage)."""
    if args.stage_dir:
        return Path(args.stage_dir).expanduser() / f"bench-{os.getpid()}-{run}"
    from rollout_service.sidecar.staging import default_stage_dir

    return default_stage_dir(f"bench-{os.getpid()}-{run}")


# --- models, servers, reporting --------------------------------------------------------------


def resolve_model(size: str) -> tuple[Path, torch.dtype]:
    if size == "tiny":
        return ensure_tiny_model(), torch.float32
    return ensure_bench_model(float(size)), torch.bfloat16


def load_trainer(model_dir: Path, dtype: torch.dtype, device: str) -> Any:
    """The trainer's copy of the model, in its own memory (not backed by the model files)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(device, copy=True)
    model.eval()
    return model


def start_server(
    model_dir: Path, dtype: torch.dtype, args: argparse.Namespace, log_dir: Path, label: str
) -> SGLangServer:
    extra = shlex.split(args.sglang_args or "")
    if not any(a.split("=")[0] == "--dtype" for a in extra):
        extra += ["--dtype", str(dtype).removeprefix("torch.")]
    if args.device == "cuda" and not any(a.split("=")[0] == "--mem-fraction-static" for a in extra):
        extra += ["--mem-fraction-static", "0.5"]  # leave room for the trainer's copy
    server = SGLangServer(
        model_dir,
        device=args.device,
        max_total_tokens=args.max_total_tokens,
        extra_args=extra,
        log_path=log_dir / f"sglang-{label}.log",
    )
    server.start()
    try:
        server.wait_healthy(args.startup_timeout)
    except BaseException:
        server.stop()
        raise
    return server


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def environment(args: argparse.Namespace) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "device": args.device,
    }
    for pkg in ("torch", "transformers", "sglang", "safetensors"):
        try:
            env[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            env[pkg] = None
    if args.device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    try:
        env["loadavg"] = os.getloadavg()
    except OSError:
        pass
    return env


def fmt(value: float | None, width: int, digits: int = 3) -> str:
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def ratio(value: float | None, width: int) -> str:
    return f"{value:>{width - 1}.2f}x" if value is not None else f"{'-':>{width}}"


def print_tables(cases: list[Case]) -> None:
    print("\nThis project's sync, phase by phase (medians, seconds):")
    head = (
        f"{'size':<6}{'storage':<16}{'GB':>6}{'publish':>9}{'(write)':>9}{'detect':>8}"
        f"{'valid.':>8}{'load':>8}{'ack':>8}{'end2end':>9}{'GB/s':>7}"
    )
    print(head)
    for c in cases:
        m = c.medians()
        e2e = m.get("ours.end_to_end_s")
        print(
            f"{c.size:<6}{c.storage[-15:]:<16}{c.model_bytes / 1e9:>6.2f}"
            f"{fmt(m.get('ours.publish_s'), 9)}{fmt(m.get('ours.publish_write_s'), 9)}"
            f"{fmt(m.get('ours.detect_s'), 8)}{fmt(m.get('ours.validate_s'), 8)}"
            f"{fmt(m.get('ours.load_s'), 8)}{fmt(m.get('ours.ack_s'), 8)}{fmt(e2e, 9)}"
            f"{fmt(c.model_bytes / e2e / 1e9 if e2e else None, 7, 2)}"
            + (f"   ERROR: {c.error.splitlines()[0][:80]}" if c.error else "")
        )
    print("\nAgainst the physical limit and the naive path (medians, seconds):")
    print(
        f"{'size':<6}{'storage':<16}{'wr+fsync':>9}{'rd hot':>8}{'rd cold':>8}{'limit':>8}"
        f"{'nv save':>8}{'nv load':>8}{'naive':>8}{'ours':>8}{'/limit':>8}{'/cold':>7}{'/naive':>8}"
        "   cold read"
    )
    for c in cases:
        m, r = c.medians(), c.ratios()
        print(
            f"{c.size:<6}{c.storage[-15:]:<16}{fmt(m.get('physical.write_fsync_s'), 9)}"
            f"{fmt(m.get('physical.read_hot_s'), 8)}{fmt(m.get('physical.read_cold_s'), 8)}"
            f"{fmt(m.get('physical.limit_s'), 8)}{fmt(m.get('naive.save_s'), 8)}"
            f"{fmt(m.get('naive.load_s'), 8)}{fmt(m.get('naive.total_s'), 8)}"
            f"{fmt(m.get('ours.end_to_end_s'), 8)}{ratio(r.get('ours/limit'), 8)}"
            f"{ratio(r.get('ours/limit-cold'), 7)}{ratio(r.get('ours/naive'), 8)}   {c.cold_read}"
        )
    if any(c.ours_nostage for c in cases):
        print(
            "\nWhat verified staging costs (every byte copied node-locally and checked before SGLang"
            " reads it) against SGLang reading shared storage directly (medians, seconds):"
        )
        print(
            f"{'size':<6}{'storage':<16}{'staged':>9}{'(valid.)':>9}{'(load)':>8}{'direct':>9}"
            f"{'(valid.)':>9}{'(load)':>8}{'ratio':>8}"
        )
        for c in cases:
            m, r = c.medians(), c.ratios()
            print(
                f"{c.size:<6}{c.storage[-15:]:<16}{fmt(m.get('ours.end_to_end_s'), 9)}"
                f"{fmt(m.get('ours.validate_s'), 9)}{fmt(m.get('ours.load_s'), 8)}"
                f"{fmt(m.get('ours_nostage.end_to_end_s'), 9)}{fmt(m.get('ours_nostage.validate_s'), 9)}"
                f"{fmt(m.get('ours_nostage.load_s'), 8)}{ratio(r.get('ours/ours_nostage'), 8)}"
            )
    if any(c.ours_delta for c in cases):
        print(
            "\nDelta sync (AdamW-stepped bf16 versions, rebuilt and verified in the stage) against today's"
            " full path on the same storage and server, and both against their physical limits (medians):"
        )
        print(
            f"{'size':<6}{'storage':<16}{'written':>9}{'of full':>8}{'encode':>8}{'publish':>8}{'apply':>7}"
            f"{'load':>7}{'delta':>8}{'full':>8}{'d/f':>7}{'limit':>8}{'d.limit':>8}{'d/limit':>8}{'d/d.limit':>10}"
        )
        for c in cases:
            m, r = c.medians(), c.ratios()
            frac = (m.get("ours_delta.bytes_written") or 0) / (m.get("ours_delta.full_bytes") or 1)
            print(
                f"{c.size:<6}{c.storage[-15:]:<16}{(m.get('ours_delta.bytes_written') or 0) / 1e6:>7.1f}MB"
                f"{100 * frac:>7.2f}%{fmt(m.get('ours_delta.encode_s'), 8)}{fmt(m.get('ours_delta.publish_s'), 8)}"
                f"{fmt(m.get('ours_delta.apply_s'), 7)}{fmt(m.get('ours_delta.load_s'), 7)}"
                f"{fmt(m.get('ours_delta.end_to_end_s'), 8)}{fmt(m.get('ours.end_to_end_s'), 8)}"
                f"{ratio(r.get('delta/full'), 7)}{fmt(m.get('physical.limit_s'), 8)}"
                f"{fmt(m.get('delta_limit.limit_with_load_s'), 8)}{ratio(r.get('delta/limit'), 8)}"
                f"{ratio(r.get('delta/limit-delta'), 10)}"
            )
        print(
            "written/of full: bytes a delta sync wrote to shared storage; apply: rebuild + verify in the stage;"
            " load: SGLang's load from the stage; delta, full: end to end publish start -> the trainer"
            " knows it is served; limit: the full path's physical limit (below); d.limit: the delta"
            " path's: its bytes written + fsync + read back, one write of the model into the stage's"
            " file system over existing pages, and SGLang's measured load"
        )
    pauses = [c for c in cases if any(r.get("pause_s") is not None for r in c.ours + c.ours_delta)]
    if pauses:
        print("\nSGLang's pause during a sync (one-token /generate probes back to back; medians, seconds):")
        print(
            f"{'size':<6}{'storage':<16}{'path':<7}{'idle':>7}{'load':>7}{'pause':>7}{'/load':>7}{'r.pause':>8}"
            f"{'/load':>7}{'ld.pause':>9}{'/load':>7}{'in load':>8}{'ld.sent':>8}{'/load':>7}"
            f"{'bare ld':>8}{'b.pause':>8}{'/load':>7}{'b.sent':>7}{'/load':>7}"
        )
        for c in pauses:
            m, r = c.medians(), c.ratios()
            for kind, label in (("ours", "full"), ("ours_delta", "delta")):
                if m.get(f"{kind}.pause_s") is None:
                    continue
                print(
                    f"{c.size:<6}{c.storage[-15:]:<16}{label:<7}{fmt(m.get(f'{kind}.idle_probe_s'), 7)}"
                    f"{fmt(m.get(f'{kind}.load_s'), 7)}{fmt(m.get(f'{kind}.pause_s'), 7)}"
                    f"{ratio(r.get(f'{label} pause/load'), 7)}{fmt(m.get(f'{kind}.replica_pause_s'), 8)}"
                    f"{ratio(r.get(f'{label} replica_pause/load'), 7)}{fmt(m.get(f'{kind}.load_pause_s'), 9)}"
                    f"{ratio(r.get(f'{label} load_pause/load'), 7)}{fmt(m.get(f'{kind}.load_probe_overlap_s'), 8)}"
                    f"{fmt(m.get(f'{kind}.load_pause_sent_s'), 8)}{ratio(r.get(f'{label} load_pause_sent/load'), 7)}"
                    f"{fmt(m.get(f'{kind}.bare_load_s'), 8)}{fmt(m.get(f'{kind}.bare_pause_s'), 8)}"
                    f"{ratio(r.get(f'{label} bare_pause/load'), 7)}{fmt(m.get(f'{kind}.bare_pause_sent_s'), 7)}"
                    f"{ratio(r.get(f'{label} bare_pause_sent/load'), 7)}"
                )
        print(
            "idle: median probe timed just before the sync with nothing else running (the baseline);"
            " pause: the longest probe during the sync (publish start -> acknowledged) less idle;"
            " r.pause: the same from the publish's rename on (the replica's part: what SGLang feels"
            " where the trainer runs elsewhere); ld.pause: over the sidecar's recorded load interval;"
            " in load: seconds of that interval probes were in flight; ld.sent: the longest probe"
            " sent during that interval less idle (the one in flight when the load began finishes"
            " on the old weights first: what slowed it was the rebuild beside it, counted in"
            " r.pause); bare ld, b.pause, b.sent: SGLang loading the same staged copy again right"
            " after, by a bare /update_weights_from_disk with the probe running and nothing else"
            " to do (SGLang's own floor; its /load is over the bare load)"
        )
    if any(c.sglang for c in cases):
        print(
            "limit = raw write+fsync + hot read (same node, just written, as SGLang reads ours; the faster"
            " of read() into a buffer and a mapping copied page by page into a tensor);"
            " naive = save_pretrained (no fsync) + the trainer's own /update_weights_from_disk"
        )
    if any(not c.sglang for c in cases):
        print(
            "--no-sglang: ours = publish only, naive = save_pretrained only (no fsync),"
            " /limit = against the raw write+fsync alone"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default=None, help="comma-separated model sizes in GB, or 'tiny' (default tiny,0.5,1,2)"
    )
    parser.add_argument(
        "--storage",
        default=None,
        help="comma-separated directories; 'local' = benchmarks/results/sync-bench-work,"
        " 'shm' = /dev/shm, 'sshfs' = a real network file system mounted for the"
        " run (sshfs over loopback; needs sshfs + openssh-server) (default local,shm)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="syncs per path (default 3)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed syncs before each timed one, per run of every path (default 2: the stage then"
        " holds a served copy and a spare, as in steady state; with --delta at least 1)",
    )
    parser.add_argument("--json", default=None, help="write all figures here")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where SGLang and the trainer's copy live (default cpu)",
    )
    parser.add_argument("--skip-naive", action="store_true", help="do not measure the naive path")
    parser.add_argument(
        "--no-sglang", action="store_true", help="trainer side only: publish, raw write, save_pretrained (no server)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: sizes tiny,0.1, storage shm, 1 repeat (unless given)"
    )
    parser.add_argument(
        "--cold-read",
        choices=("auto", "drop_caches", "fadvise"),
        default="auto",
        help="how to empty the page cache before the cold read (default: drop_caches when writable, else fadvise)",
    )
    parser.add_argument("--max-total-tokens", type=int, default=4096, help="SGLang KV cache (CPU)")
    parser.add_argument(
        "--sglang-args",
        default="",
        help="extra SGLang flags as one string; write --sglang-args='--flag ...' (with '=')",
    )
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="SGLang /health wait, s")
    parser.add_argument("--sync-timeout", type=float, default=900.0, help="one load's wait, s")
    parser.add_argument(
        "--log-dir", default=None, help="SGLang and sidecar logs (default benchmarks/results/sync-bench-logs)"
    )
    parser.add_argument(
        "--delta",
        action="store_true",
        help="measure delta syncs (ours_delta) beside today's full path instead of the unstaged one",
    )
    parser.add_argument(
        "--delta-lr", type=float, default=1e-6, help="AdamW learning rate of the delta runs' updates (default 1e-6)"
    )
    parser.add_argument(
        "--delta-from",
        choices=("master", "bf16"),
        default="master",
        help=(
            "with --delta, what both kinds publish: 'master' (default) the trainer's fp32 master weights,"
            " cast to bf16 by the publisher inside the timed sync; 'bf16' bf16 copies the trainer cast"
            " before the sync (as a GPU trainer hands them over after casting on the device)"
        ),
    )
    parser.add_argument(
        "--adam-warmup",
        type=int,
        default=3,
        help="with --delta, untimed AdamW steps before the first version (default 3, as delta_bench:"
        " Adam's first steps move every weight by lr)",
    )
    parser.add_argument(
        "--idle-probe-s",
        type=float,
        default=3.0,
        help="seconds of /generate probes timed with nothing else running before each timed sync: the"
        " pause's baseline (default 3)",
    )
    parser.add_argument(
        "--no-probe",
        action="store_true",
        help="no /generate probe during the syncs (no pause figure; end to end with SGLang idle)",
    )
    parser.add_argument(
        "--stage-dir", default=None, help="the sidecar's stage (default: its own choice, /dev/shm when it has room)"
    )
    args = parser.parse_args(argv)
    quick = {"sizes": "tiny,0.1", "storage": "shm", "repeats": 1}
    full = {"sizes": "tiny,0.5,1,2", "storage": "local,shm", "repeats": 3}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.repeats < 1 or args.warmup < 0 or args.adam_warmup < 0 or args.idle_probe_s < 0:
        parser.error(
            "--repeats must be at least 1 and --warmup, --adam-warmup, --idle-probe-s at least 0, got"
            f" {args.repeats}, {args.warmup}, {args.adam_warmup}, {args.idle_probe_s}"
        )
    for size in args.sizes.split(","):
        if size != "tiny":
            try:
                float(size)
            except ValueError:
                parser.error(f"--sizes takes 'tiny' or numbers of GB, got {size!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # `timeout` sends SIGTERM: unwind so that SGLang and the sidecar are stopped, not orphaned.
    signal.signal(signal.SIGTERM, _interrupted)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("rollout_service.checkpoint_writer").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device")
    mounts = contextlib.ExitStack()
    storages = []
    for label in args.storage.split(","):
        if label == "sshfs":  # a real network file system: sshfs over loopback (tests/shared_fs.py)
            from shared_fs import sshfs_mount

            _, mnt = mounts.enter_context(sshfs_mount(Path(tempfile.mkdtemp(prefix="sync-bench-fs-"))))
            storages.append((label, mnt))
        else:
            storages.append((label, STORAGE_ALIASES.get(label, Path(label)).expanduser()))
    with mounts:
        return _run_all(args, storages)


def _run_all(args: argparse.Namespace, storages: list[tuple[str, Path]]) -> int:
    log_dir = Path(args.log_dir) if args.log_dir else REPO / "benchmarks" / "results" / "sync-bench-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for _, storage in storages:
        storage.mkdir(parents=True, exist_ok=True)
    cases: list[Case] = []
    for size in args.sizes.split(","):
        progress(f"== size {size}")
        size_cases = [
            Case(size=size, storage=label, path=str(s), fs_type=fs_type(s), cold_read="", sglang=not args.no_sglang)
            for label, s in storages
        ]
        cases += size_cases
        server = None
        trainer = master = None
        try:
            model_dir, dtype = resolve_model(size)
            trainer = load_trainer(model_dir, dtype, args.device)
            state = dict(iter_unique_tensors(trainer.state_dict().items()))
            cpu_state = state if args.device == "cpu" else {k: v.cpu() for k, v in state.items()}
            nbytes = sum(t.numel() * t.element_size() for t in cpu_state.values())
            progress(f"   model {model_dir} ({nbytes / 1e9:.3f} GB, {len(state)} tensors, {dtype})")
            tensor_count = len(state)
            if args.delta:  # the trainer's fp32 master weights, which both kinds publish
                master = {k: torch.nn.Parameter(v.detach().float()) for k, v in state.items()}
            if args.delta and args.skip_naive and args.device == "cpu":
                # The trainer's fp32 weights stand for the model from here on, and the bf16 model
                # goes: at 2 GB, the fp32 weights, AdamW's two states, the writer's held copy and
                # SGLang then leave room in 24 GB for the stage's pages.
                trainer = state = cpu_state = None
                gc.collect()
            if not args.no_sglang:
                server = start_server(model_dir, dtype, args, log_dir, size)
            for case, (_, storage) in zip(size_cases, storages):
                case.model_bytes, case.tensors = nbytes, tensor_count
                work = Path(tempfile.mkdtemp(prefix=f"sync-bench-{size}-", dir=storage))
                progress(f"-- size {size}, storage {storage} ({case.fs_type}), work {work}")
                try:
                    case.cold_read = choose_cold_read(work, args.cold_read)
                    run_case(
                        case, work, args, trainer, state, cpu_state, model_dir / "config.json", server, log_dir, master
                    )
                except Exception:
                    case.error = traceback.format_exc()
                    progress(case.error)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
        except Exception:
            error = traceback.format_exc()
            progress(error)
            for case in size_cases:
                case.error = case.error or error
        except KeyboardInterrupt as exc:
            for case in size_cases:
                case.error = case.error or f"interrupted ({exc}) before this case finished"
            raise
        finally:
            if server is not None:
                server.stop()
            trainer = state = cpu_state = master = None
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
            write_json(args, cases, log_dir)  # after each size: a killed run keeps what it measured
    print_tables(cases)
    return 1 if any(c.error for c in cases) else 0


def write_json(args: argparse.Namespace, cases: list[Case], log_dir: Path) -> None:
    if not args.json:
        return
    out = {
        "config": vars(args),
        "environment": environment(args),
        "log_dir": str(log_dir),
        "results": [
            {
                "size": c.size,
                "storage": c.storage,
                "path": c.path,
                "fs_type": c.fs_type,
                "cold_read": c.cold_read,
                "sglang": c.sglang,
                "model_bytes": c.model_bytes,
                "tensors": c.tensors,
                "median_s": c.medians(),
                "ratios": c.ratios(),
                "runs": {kind: getattr(c, kind) for kind in Case.KINDS},
                "error": c.error,
            }
            for c in cases
        ],
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
