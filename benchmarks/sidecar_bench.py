"""Sidecar detection latency and overhead per sync, against a direct SGLang load call.

    ./scripts/run.sh python benchmarks/sidecar_bench.py [--syncs 10] [--poll 1.0]

Starts one real SGLang server on the tiny model (CPU), then for each watch mode
(inotify, polling every ``--poll`` seconds) a sidecar subprocess, and publishes
``--syncs`` checkpoints one after another, waiting for each to be served. From
the sidecar's ``/status`` it takes, per sync:

* detect -> load start: publish finished (step directory renamed into place) -> the sidecar's
  ``/update_weights_from_disk`` call sent (``last_sync``'s ``load_started_at``);
* SGLang's own ``/update_weights_from_disk`` time;
* the sidecar's overhead: publish finished -> served (the sidecar's ``total_s``), minus SGLang's
  load time;
* publish -> acknowledged: publish finished -> the trainer's ``/wait`` for the step returned.

As a baseline, in the same process and on the same server, it times the trainer
calling ``/update_weights_from_disk`` itself on the same checkpoints (the path of
the original TRL pull request). Prints medians and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from rollout_service.sglang_launcher import SGLangServer  # noqa: E402
from rollout_service.tiny_model import ensure_tiny_model  # noqa: E402
from sidecar_helpers import Sidecar, publish_step  # noqa: E402


def run_mode(
    server: SGLangServer, model: Path, work: Path, mode: str, syncs: int, poll: float, first_step: int
) -> list[dict]:
    root = work / f"ckpt-{mode}"
    root.mkdir()
    extra = ("--poll", str(poll)) if mode == "polling" else ()
    sidecar = Sidecar(root, server.url, work / f"sidecar-{mode}.log", *extra, replica_id=mode)
    records = []
    try:
        time.sleep(1.0)
        for i in range(syncs):
            step = first_step + i
            publish_step(root, model, step)
            sidecar.wait_step(step, timeout_s=120)
            acked = time.time()
            last = sidecar.status()["last_sync"]
            published = last["finished_at"] - last["total_s"]
            records.append(
                {
                    "step": step,
                    "detect_to_load_start_s": last["load_started_at"] - published,
                    "detect_s": last["detect_s"],
                    "validate_s": last["validate_s"],
                    "load_s": last["load_s"],
                    "total_s": last["total_s"],
                    "overhead_s": last["total_s"] - last["load_s"],
                    "acked_s": acked - published,
                }
            )
            time.sleep(0.2)
    finally:
        sidecar.stop()
    return records


def run_direct(server: SGLangServer, model: Path, work: Path, syncs: int, first_step: int) -> list[float]:
    root = work / "ckpt-direct"
    times = []
    for i in range(syncs):
        step = first_step + i
        path = publish_step(root, model, step).path
        t0 = time.perf_counter()
        r = httpx.post(
            f"{server.url}/update_weights_from_disk",
            json={"model_path": str(path), "weight_version": str(step)},
            timeout=300,
        )
        r.raise_for_status()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--syncs", type=int, default=10)
    parser.add_argument("--poll", type=float, default=1.0, help="polling period of the polling mode")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = ensure_tiny_model()
    work = Path(tempfile.mkdtemp(prefix="sidecar-bench-"))
    results: dict = {}
    with SGLangServer(model, device="cpu", log_path=work / "sglang.log") as server:
        results["direct_load_s"] = run_direct(server, model, work, args.syncs, 1)
        for n, mode in enumerate(("inotify", "polling")):
            results[mode] = run_mode(server, model, work, mode, args.syncs, args.poll, 1000 * (n + 1))
    med = statistics.median
    print(f"{args.syncs} syncs per mode, tiny model, polling period {args.poll} s")
    print(
        f"{'path':<10}{'detect->load start':>20}{'SGLang load':>13}{'sidecar overhead':>18}"
        f"{'publish->served':>17}{'publish->acked':>16}   (medians, seconds)"
    )
    summary = {}
    keys = ("detect_to_load_start_s", "load_s", "overhead_s", "total_s", "acked_s")
    for mode in ("inotify", "polling"):
        recs = results[mode]
        row = {k: med([r[k] for r in recs]) for k in keys}
        summary[mode] = row
        print(
            f"{mode:<10}{row['detect_to_load_start_s']:>20.3f}{row['load_s']:>13.3f}"
            f"{row['overhead_s']:>18.3f}{row['total_s']:>17.3f}{row['acked_s']:>16.3f}"
        )
    direct = med(results["direct_load_s"])
    summary["direct_load_s"] = direct
    print(
        f"{'direct':<10}{'-':>20}{direct:>13.3f}{'-':>18}{direct:>17.3f}{direct:>16.3f}"
        "   (trainer calls /update_weights_from_disk itself)"
    )
    print(
        "ratio publish->acked / direct load: "
        + ", ".join(f"{m} {summary[m]['acked_s'] / direct:.1f}x" for m in ("inotify", "polling"))
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
