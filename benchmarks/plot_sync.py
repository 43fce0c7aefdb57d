"""Plot sync time against model size from ``sync_bench.py --json`` output (one PNG per storage).

    ./scripts/run.sh python benchmarks/plot_sync.py benchmarks/results/sync.json --out docs/img

One line per path: the physical limit (write + fsync + read of the same bytes), the naive path
(save_pretrained + a direct load call), and this project's publish -> served end to end.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

LINES = (
    ("physical.limit_s", "physical limit (write+fsync+read)"),
    ("naive.total_s", "naive: save_pretrained + load call"),
    ("ours.end_to_end_s", "ours: publish -> sidecar -> served"),
    ("ours.load_s", "  of which SGLang's load"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json_file")
    parser.add_argument("--out", default="docs/img")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(args.json_file).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for storage in sorted({r["storage"] for r in data["results"]}):
        rows = sorted((r for r in data["results"] if r["storage"] == storage), key=lambda r: r["model_bytes"])
        fig, ax = plt.subplots(figsize=(7, 4.5))
        gb = [r["model_bytes"] / 1e9 for r in rows]
        for key, label in LINES:
            ys = [r["median_s"].get(key) for r in rows]
            if any(y is not None for y in ys):
                ax.plot(
                    gb,
                    [float("nan") if y is None else y for y in ys],
                    marker="o",
                    label=label,
                    linestyle="--" if key.startswith("physical") else "-",
                )
        ax.set_xlabel("checkpoint size (GB, bf16)")
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"Weight sync time vs model size ({storage}, {data['environment']['device']})")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / f"sync_vs_size_{storage}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        print(path)


if __name__ == "__main__":
    main()
