"""Publish throughput against the physical limit: a raw write + fsync of the same bytes.

    ./scripts/run.sh python benchmarks/publish_bench.py [--gb 1.0] [--dir DIR] [--repeats 3]

For a state dict of about ``--gb`` GB (Qwen2-like tensor shapes, bfloat16), each
repeat runs, in the same process and directory, in alternating order:

* ``raw``: write the tensors' bytes to one file and fsync it (the physical limit);
* ``save_file``: ``safetensors.torch.save_file`` + fsync (the library baseline);
* ``publish``: ``publish_checkpoint`` (header, digests, manifest, fsyncs, rename).

It prints the median seconds and GB/s of each and the ratios publish/raw and
publish/save_file, and writes them as JSON (``--json``). Also measures the digest
(xxh3-128) against sha256 and blake2b on the same bytes in memory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import xxhash
from safetensors.torch import save_file

from rollout_service.checkpoint_writer import publish_checkpoint


def make_state(total_bytes: int) -> dict[str, torch.Tensor]:
    """Qwen2-0.5B-like layer shapes in bfloat16, repeated until ``total_bytes``."""
    hidden, inter = 896, 4864
    layer = {
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (128, hidden),
        "self_attn.v_proj.weight": (128, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
    }
    state: dict[str, torch.Tensor] = {}
    size, i = 0, 0
    g = torch.Generator().manual_seed(0)
    while size < total_bytes:
        for name, shape in layer.items():
            t = torch.randn(shape, generator=g, dtype=torch.float32).to(torch.bfloat16)
            state[f"model.layers.{i}.{name}"] = t
            size += t.numel() * 2
        i += 1
    return state


def raw_write(path: Path, state: dict[str, torch.Tensor]) -> None:
    with open(path, "wb", buffering=0) as f:
        for t in state.values():
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        os.fsync(f.fileno())


def lib_write(path: Path, state: dict[str, torch.Tensor]) -> None:
    save_file(state, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def digest_figures(state: dict[str, torch.Tensor]) -> dict[str, float]:
    views = [memoryview(t.reshape(-1).view(torch.uint8).numpy()) for t in state.values()]
    nbytes = sum(len(v) for v in views)
    out = {}
    for name, factory in (("xxh3_128", xxhash.xxh3_128), ("sha256", hashlib.sha256), ("blake2b", hashlib.blake2b)):
        h = factory()
        t0 = time.perf_counter()
        for v in views:
            h.update(v)
        h.hexdigest()
        out[name] = nbytes / (time.perf_counter() - t0) / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="state dict size in GB")
    parser.add_argument("--dir", default=None, help="directory to write in (default: a temp dir under ./)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()

    state = make_state(int(args.gb * 1e9))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    base = Path(tempfile.mkdtemp(prefix="publish-bench-", dir=args.dir or "."))
    times: dict[str, list[float]] = {"raw": [], "save_file": [], "publish": []}
    try:
        for rep in range(args.repeats):
            order = ["raw", "save_file", "publish"]
            if rep % 2:
                order.reverse()
            for kind in order:
                target = base / f"{kind}-{rep}"
                target.mkdir()
                if kind == "raw":
                    times[kind].append(timed(lambda target=target: raw_write(target / "raw.bin", state)))
                elif kind == "save_file":
                    times[kind].append(timed(lambda target=target: lib_write(target / "model.safetensors", state)))
                else:
                    times[kind].append(
                        timed(
                            lambda target=target: publish_checkpoint(
                                target, 1, state.items(), config={"model_type": "qwen2"}
                            )
                        )
                    )
                shutil.rmtree(target)
        digests = digest_figures(state)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"state dict: {len(state)} tensors, {nbytes / 1e9:.2f} GB (bf16), {args.repeats} repeats,"
        f" directory {base.parent.resolve()}"
    )
    print(f"{'path':<12}{'median s':>10}{'GB/s':>8}   all runs (s)")
    for k in ("raw", "save_file", "publish"):
        print(f"{k:<12}{med[k]:>10.3f}{nbytes / med[k] / 1e9:>8.2f}   " + " ".join(f"{x:.3f}" for x in times[k]))
    ratios = {"publish/raw": med["publish"] / med["raw"], "publish/save_file": med["publish"] / med["save_file"]}
    print("ratios: " + ", ".join(f"{k} = {v:.2f}x" for k, v in ratios.items()) + "   (goal: publish/raw <= 1.2x)")
    print("digest speed in memory (GB/s): " + ", ".join(f"{k} {v:.2f}" for k, v in digests.items()))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"bytes": nbytes, "runs_s": times, "median_s": med, "ratios": ratios, "digest_gb_per_s": digests},
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
