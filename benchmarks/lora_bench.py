"""LoRA sync: the adapter alone vs the merged model, bytes and end-to-end time per sync.

    ./scripts/run.sh python benchmarks/lora_bench.py [--sizes 0.5,1] [--ranks 8,16,64]
        [--storage local,shm,sshfs] [--repeats 2] [--json OUT]

For each benchmark model (``model_factory.py``: random-weight bf16 Qwen2 of about 0.5 / 1 GB) one
real SGLang is started with LoRA serving (``LoraServing``: ``--enable-lora``, rank <= 64, every
projection; ``torch_native`` on the CPU). The trainer's copy is wrapped in a PEFT LoRA of each
rank with TRL's default target modules (PEFT's default for Qwen2: ``q_proj``, ``v_proj``; random
``lora_B`` so the adapter changes the model). For each storage (local disk, ``/dev/shm``, sshfs
over loopback = a real network file system, ``tests/shared_fs.py``) and rank it times, from the
trainer's point of view (start of the sync -> the sidecar's ``/wait`` answers that SGLang serves
the version):

* ``adapter``: ``get_peft_model_state_dict`` -> ``publish_adapter`` -> the sidecar validates,
  stages and loads it with ``/load_lora_adapter`` (what ``trainer_hooks`` does with adapter sync);
* ``merged``: ``iter_full_weights`` (merge, copy, unmerge) -> ``publish_checkpoint`` -> the
  sidecar validates, stages and loads the full checkpoint with ``/update_weights_from_disk``
  (the merged fallback, and what every LoRA sync cost before adapter sync).

Each mode runs with its own sidecar and checkpoint root; after the merged runs SGLang is put
back on its base weights. Prints medians, bytes per sync and merged/adapter ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import platform
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import httpx
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from model_factory import ensure_bench_model  # noqa: E402

from rollout_service.adapter_writer import publish_adapter  # noqa: E402
from rollout_service.checkpoint_writer import publish_checkpoint  # noqa: E402
from rollout_service.lora_serving import LoraServing  # noqa: E402
from rollout_service.sglang_launcher import SGLangServer  # noqa: E402

STORAGE = {"local": Path("~/.cache/rollout-service/lora-bench").expanduser(), "shm": Path("/dev/shm")}


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def wait_served(sidecar: Any, step: int, timeout_s: float) -> None:
    r = sidecar.get(f"/wait?version={step}&timeout={timeout_s}", timeout=timeout_s + 30)
    if r.status_code != 200:
        raise RuntimeError(f"step {step} not served: {r.text[:400]}\n{sidecar.log_tail()}")


def adapter_sync(model: Any, root: Path, step: int, sidecar: Any, timeout_s: float) -> dict[str, float]:
    from peft import get_peft_model_state_dict

    t0 = time.perf_counter()
    state = {k: v.detach().cpu() for k, v in get_peft_model_state_dict(model).items()}
    result = publish_adapter(root, step, state, model.peft_config["default"].to_dict(), run_id="bench")
    t1 = time.perf_counter()
    wait_served(sidecar, step, timeout_s)
    return {"bytes": result.total_bytes, "publish_s": t1 - t0, "end_to_end_s": time.perf_counter() - t0}


def merged_sync(model: Any, root: Path, step: int, config: Path, sidecar: Any, timeout_s: float) -> dict[str, float]:
    from trainer_hooks.weight_gather import iter_full_weights

    t0 = time.perf_counter()
    result = publish_checkpoint(root, step, iter_full_weights(model), config=config, run_id="bench")
    t1 = time.perf_counter()
    wait_served(sidecar, step, timeout_s)
    return {"bytes": result.total_bytes, "publish_s": t1 - t0, "end_to_end_s": time.perf_counter() - t0}


def with_sidecar(root: Path, server: SGLangServer, model_dir: Path, log: Path, work: Path):
    from sidecar_helpers import Sidecar

    sidecar = Sidecar(
        root,
        server.url,
        log,
        "--deep-health-interval",
        "3600",
        "--reference-dir",
        str(model_dir),
        "--stage-dir",
        str(work / f"stage-{root.name}"),
        replica_id=f"bench-{root.name}",
    )
    deadline = time.monotonic() + 120
    while not (sidecar.status().get("sglang_healthy") and sidecar.status().get("reference")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"sidecar never saw SGLang healthy:\n{sidecar.log_tail()}")
        time.sleep(0.2)
    return sidecar


def run_storage(
    label: str,
    storage: Path,
    model_dir: Path,
    server: SGLangServer,
    base: Any,
    ranks: list[int],
    args: argparse.Namespace,
    log_dir: Path,
) -> list[dict[str, Any]]:
    from peft import LoraConfig, get_peft_model

    rows = []
    work = Path(tempfile.mkdtemp(prefix="lora-bench-", dir=storage))
    stage_work = Path(tempfile.mkdtemp(prefix="lora-bench-stage-", dir="/dev/shm"))
    step = 0
    try:
        for rank in ranks:
            torch.manual_seed(rank)
            model = get_peft_model(
                base, LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False, task_type="CAUSAL_LM")
            )
            model.eval()
            row: dict[str, Any] = {
                "storage": label,
                "rank": rank,
                "target_modules": sorted(model.peft_config["default"].target_modules),
            }
            for mode in ("adapter", "merged"):
                root = work / f"{mode}-r{rank}"
                root.mkdir()
                sidecar = with_sidecar(
                    root, server, model_dir, log_dir / f"sidecar-{label}-{mode}-{rank}.log", stage_work
                )
                runs = []
                try:
                    for rep in range(args.warmup + args.repeats):
                        step += 1
                        with torch.no_grad():  # a new version: the adapter moved
                            for n, p in model.named_parameters():
                                if "lora_B" in n:
                                    p.add_(torch.randn_like(p) * 1e-3)
                        if mode == "adapter":
                            run = adapter_sync(model, root, step, sidecar, args.sync_timeout)
                        else:
                            run = merged_sync(model, root, step, model_dir / "config.json", sidecar, args.sync_timeout)
                        if rep >= args.warmup:
                            runs.append(run)
                            progress(
                                f"  {label} r{rank} {mode}: {run['end_to_end_s']:.3f} s, {run['bytes'] / 1e6:.2f} MB"
                            )
                        for old in root.glob("step-*"):
                            if old.name != f"step-{step:08d}":
                                shutil.rmtree(old, ignore_errors=True)
                finally:
                    sidecar.stop()
                    shutil.rmtree(root, ignore_errors=True)
                row[mode] = {
                    "runs": runs,
                    "median_s": statistics.median(r["end_to_end_s"] for r in runs),
                    "bytes": runs[-1]["bytes"],
                    "publish_median_s": statistics.median(r["publish_s"] for r in runs),
                }
                if mode == "merged":  # SGLang back on its base weights for the next adapters
                    r = httpx.post(
                        f"{server.url}/update_weights_from_disk",
                        json={"model_path": str(model_dir), "weight_version": "default"},
                        timeout=600,
                    )
                    r.raise_for_status()
            row["speedup"] = row["merged"]["median_s"] / row["adapter"]["median_s"]
            row["bytes_ratio"] = row["merged"]["bytes"] / row["adapter"]["bytes"]
            rows.append(row)
            base = model.unload()  # the plain base model again, for the next rank
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(stage_work, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.5,1", help="benchmark model sizes in GB")
    parser.add_argument("--ranks", default="8,16,64")
    parser.add_argument("--storage", default="local,shm,sshfs")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--sync-timeout", type=float, default=900.0)
    parser.add_argument("--json", default=None, help="write all figures here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    log_dir = REPO / "benchmarks" / "results" / "lora-bench-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    ranks = [int(r) for r in args.ranks.split(",")]
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as mounts:
        storages = []
        for label in args.storage.split(","):
            if label == "sshfs":
                from shared_fs import sshfs_mount

                _, mnt = mounts.enter_context(sshfs_mount(Path(tempfile.mkdtemp(prefix="lora-bench-fs-"))))
                storages.append((label, mnt))
            else:
                STORAGE[label].mkdir(parents=True, exist_ok=True)
                storages.append((label, STORAGE[label]))
        for size in args.sizes.split(","):
            model_dir = ensure_bench_model(float(size))
            from transformers import AutoModelForCausalLM

            base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
            server = SGLangServer(
                model_dir,
                device="cpu",
                max_total_tokens=4096,
                extra_args=["--dtype", "bfloat16"],
                log_path=log_dir / f"sglang-{size}.log",
                lora=LoraServing(max_rank=max(ranks)),
            )
            server.start()
            try:
                server.wait_healthy(900)
                for label, storage in storages:
                    progress(f"== {size} GB on {label} ({storage})")
                    try:
                        for row in run_storage(label, storage, model_dir, server, base, ranks, args, log_dir):
                            row["size_gb"] = size
                            results.append(row)
                    except Exception:
                        progress(traceback.format_exc())
                        results.append({"size_gb": size, "storage": label, "error": traceback.format_exc()})
            finally:
                server.stop()
    print(
        f"\n{'size':>5} {'storage':>8} {'rank':>5} {'adapter MB':>11} {'merged MB':>10} {'adapter s':>10}"
        f" {'merged s':>9} {'speedup':>8} {'bytes x':>8}"
    )
    for row in results:
        if "error" in row:
            print(f"{row['size_gb']:>5} {row['storage']:>8}  ERROR (see stderr)")
            continue
        print(
            f"{row['size_gb']:>5} {row['storage']:>8} {row['rank']:>5} {row['adapter']['bytes'] / 1e6:>11.2f}"
            f" {row['merged']['bytes'] / 1e6:>10.1f} {row['adapter']['median_s']:>10.3f}"
            f" {row['merged']['median_s']:>9.3f} {row['speedup']:>7.1f}x {row['bytes_ratio']:>7.0f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": platform.platform(), "results": results}, indent=2))
    return 0 if results and not any("error" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
