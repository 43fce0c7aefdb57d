"""What ``sync_bench.py`` and ``delta_bench.py`` compare against: physical limits and pauses.

Physical limits are lower bounds: the same bytes moved with nothing but the kernel's own
copies, so that a sync that takes 1.1x its limit has little left to gain, whatever the code.

* :func:`write_fsync`: one sequential write + fsync of the bytes (the storage's own speed).
* :func:`read_back`: the file read once with ``read()`` into a reused buffer and once through a
  memory map whose every page is copied into a tensor (how safetensors hands SGLang a
  checkpoint to copy into its weights); the faster of the two counts, so that neither reader
  can beat the limit.
* :func:`stage_write`: one write of the model's bytes over an existing file of the node-local
  stage's file system (no fsync), at memory speed: what a delta sync cannot avoid, since each
  replica has to materialise the whole new version before SGLang loads it. Written over existing
  pages, as the stage writes each version over its spare copy in steady state.

The pause figures come from one-token ``/generate`` probes (spans of wall-clock time) sent back
to back during a sync; :func:`pause_over`, :func:`pause_started_in` and :func:`overlap_seconds`
are their arithmetic,
against an idle baseline timed just before the sync with nothing else running.
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

CHUNK = 64 << 20
"""Bytes per read and per copy (reused buffers, allocated and touched outside any timing)."""

_buffers: dict[str, torch.Tensor] = {}


def _buffer(name: str) -> torch.Tensor:
    """One reused, already touched ``CHUNK``-byte uint8 tensor per use."""
    if name not in _buffers:
        if name == "fill":  # incompressible, so that no storage or link saves on zeros
            buf = torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        else:
            buf = torch.ones(CHUNK, dtype=torch.uint8)
        _buffers[name] = buf
    return _buffers[name]


def _write_all(fd: int, view: memoryview) -> None:
    written = 0
    while written < len(view):
        written += os.write(fd, view[written:])


def write_fsync(path: Path, nbytes: int | None = None, tensors: Iterable[torch.Tensor] | None = None) -> float:
    """Seconds to write + fsync ``nbytes`` of filler, or the bytes of ``tensors`` (only the
    writes and the fsync are timed: the tensors may be made one by one as they are written)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        seconds = 0.0
        if tensors is not None:
            for t in tensors:
                view = memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())
                t0 = time.perf_counter()
                _write_all(fd, view)
                seconds += time.perf_counter() - t0
        else:
            fill = memoryview(_buffer("fill").numpy())
            left = int(nbytes or 0)
            t0 = time.perf_counter()
            while left > 0:
                n = min(left, len(fill))
                _write_all(fd, fill[:n])
                left -= n
            seconds += time.perf_counter() - t0
        t0 = time.perf_counter()
        os.fsync(fd)
        return seconds + time.perf_counter() - t0
    finally:
        os.close(fd)


def read_copy(path: Path) -> float:
    """Seconds to ``read()`` the whole file into a reused buffer."""
    view = memoryview(_buffer("read").numpy())
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    return time.perf_counter() - t0


def read_mmap(path: Path) -> float:
    """Seconds to map the file and copy every page of it into a tensor (torch's copy, as a
    safetensors load into a model's weights does; page faults included)."""
    dest = _buffer("mmap")
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                with warnings.catch_warnings():  # a read-only mapping: torch warns, nothing writes to it
                    warnings.simplefilter("ignore", UserWarning)
                    src = torch.frombuffer(mapped, dtype=torch.uint8)
                for off in range(0, size, CHUNK):
                    n = min(CHUNK, size - off)
                    dest[:n].copy_(src[off : off + n])
                del src  # the mapping closes only once no tensor views it
    return time.perf_counter() - t0


def read_back(path: Path) -> dict[str, float]:
    """The file read both ways (``read_copy_s``, ``read_mmap_s``) and the faster (``read_s``)."""
    copy_s = read_copy(path)
    mmap_s = read_mmap(path)
    return {"read_copy_s": copy_s, "read_mmap_s": mmap_s, "read_s": min(copy_s, mmap_s)}


def stage_write(folder: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` over an existing file in ``folder`` (the stage's file system;
    not inside a stage directory, whose sidecar adopts only its own names). The file is made
    first, untimed, so the timed write finds its pages there, as a rebuild over the spare does."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".bench-stage-write-{os.getpid()}"
    try:
        write_fsync(path, nbytes)
        fill = memoryview(_buffer("fill").numpy())
        fd = os.open(path, os.O_WRONLY)
        try:
            left = nbytes
            t0 = time.perf_counter()
            while left > 0:
                n = min(left, len(fill))
                _write_all(fd, fill[:n])
                left -= n
            return time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)


def delta_limit(work: Path, delta_bytes: int, stage_folder: Path, model_bytes: int) -> dict[str, float]:
    """The delta path's physical limit: the delta's bytes written + fsync'd to the storage and
    read back, and one write of the whole model into the stage's file system."""
    path = work / "limit-delta.bin"
    try:
        write_s = write_fsync(path, delta_bytes)
        read = read_back(path)
    finally:
        path.unlink(missing_ok=True)
    stage_s = stage_write(stage_folder, model_bytes)
    return {
        "delta_write_fsync_s": write_s,
        "delta_read_s": read["read_s"],
        "stage_write_s": stage_s,
        "limit_s": write_s + read["read_s"] + stage_s,
    }


# --- the pause probe's arithmetic ------------------------------------------------------------


def idle_baseline(durations: Sequence[float]) -> float | None:
    """The median of probes timed with nothing else running (None without any)."""
    return statistics.median(durations) if durations else None


def pause_over(spans: Iterable[tuple[float, float]], start: float, end: float, idle: float | None) -> float | None:
    """The longest probe overlapping [start, end], less the idle baseline (None: no probe
    overlapped, or no baseline)."""
    return _longest_over_idle([b - a for a, b in spans if a < end and b > start], idle)


def pause_started_in(
    spans: Iterable[tuple[float, float]], start: float, end: float, idle: float | None
) -> float | None:
    """The longest probe sent during [start, end], less the idle baseline (None: none was sent
    then, or no baseline). A load holds back the requests that arrive while it runs; the probe
    already in flight when it begins finishes on the old weights first, and what slowed that
    one (the sidecar's rebuild on the same cores) is the sync's pause, not the load's."""
    return _longest_over_idle([b - a for a, b in spans if start <= a <= end], idle)


def _longest_over_idle(durations: list[float], idle: float | None) -> float | None:
    """The longest of ``durations`` less ``idle`` (never below 0); None without either."""
    if not durations or idle is None:
        return None
    return max(0.0, max(durations) - idle)


def overlap_seconds(spans: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] that probes were in flight (probes run one at a time, so their
    spans do not overlap each other)."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)


def spans_near(
    spans: Iterable[tuple[float, float]], start: float, end: float, margin: float = 0.5
) -> list[tuple[float, float]]:
    """The probes in flight within ``margin`` seconds of [start, end], as (sent, answered) in
    seconds from ``start`` (ms precision): what the JSON keeps to show how probes met a load."""
    return [(round(a - start, 3), round(b - start, 3)) for a, b in spans if a < end + margin and b > start - margin]
