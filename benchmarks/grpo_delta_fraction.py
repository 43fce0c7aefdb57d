"""How much a real TRL GRPO step changes: the demo's GRPO run (real SGLang through `serve`, real
TRL) at a given learning rate, then, for each pair of consecutive published versions, the share
of bf16 elements that changed and the delta's bytes against the full checkpoint's.

    ./scripts/run.sh python benchmarks/grpo_delta_fraction.py --lr 1e-6 --steps 10

The versions are rebuilt from the published chain with ``materialize`` (every byte verified), so
the figures are what the replicas received.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from rollout_demo.demo import run_demo
from rollout_service.checkpoint_format import Manifest
from rollout_service.checkpoint_reader import list_checkpoints
from rollout_service.delta_apply import materialize


def load_dir(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lr", type=float, default=1e-6, help="learning rate (default 1e-6)")
    ap.add_argument("--steps", type=int, default=10, help="GRPO steps (default 10)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="grpo-delta-"))
    summary = run_demo(work / "run", steps=args.steps, learning_rate=args.lr, plot=False)
    root = work / "run" / "checkpoints"
    steps = [c.step for c in list_checkpoints(root)]
    rows = []
    previous = None
    for step in steps:
        out = work / f"v{step}"
        materialize(root, step, out)
        weights = load_dir(out)
        manifest = Manifest.load(root / f"step-{step:08d}")
        if previous is not None:
            changed = total = 0
            for k, t in weights.items():
                before = previous[k]
                if t.dtype in (torch.bfloat16, torch.float16):
                    changed += int((t.view(torch.int16) != before.view(torch.int16)).sum())
                    total += t.numel()
            full = sum(
                e.size for e in (manifest.delta.target_files.values() if manifest.delta else manifest.files.values())
            )
            rows.append(
                {
                    "step": step,
                    "kind": manifest.kind,
                    "changed_fraction": changed / max(total, 1),
                    "bytes_ratio": manifest.total_bytes / full,
                }
            )
            print(
                f"step {step:>3} {manifest.kind:>5}: {100 * rows[-1]['changed_fraction']:6.2f}% of bf16"
                f" elements changed, {100 * rows[-1]['bytes_ratio']:6.2f}% of the full bytes written",
                flush=True,
            )
        previous = weights
    deltas = [r for r in rows if r["kind"] == "delta"]
    if deltas:
        mean_changed = sum(r["changed_fraction"] for r in deltas) / len(deltas)
        mean_bytes = sum(r["bytes_ratio"] for r in deltas) / len(deltas)
        print(
            f"lr {args.lr:g}: mean over {len(deltas)} delta steps: {100 * mean_changed:.2f}% changed,"
            f" {100 * mean_bytes:.2f}% of the bytes; reward {summary['reward_first']:.3f} ->"
            f" {summary['reward_last']:.3f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"lr": args.lr, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
