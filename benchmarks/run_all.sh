#!/usr/bin/env bash
# Run every CPU benchmark in sequence and keep their JSON and text output in benchmarks/results/.
#   ./scripts/run.sh bash benchmarks/run_all.sh [SIZES]     (SIZES for sync_bench, default tiny,0.5,1,2)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=benchmarks/results
mkdir -p "$OUT"
SIZES="${1:-tiny,0.5,1,2}"
run() { local name=$1; shift; echo "== $name: $*"; "$@" 2>"$OUT/$name.err" | tee "$OUT/$name.txt"; }
run publish-local python benchmarks/publish_bench.py --gb 1.0 --repeats 5 --json "$OUT/publish-local.json"
run publish-shm python benchmarks/publish_bench.py --gb 1.0 --repeats 5 --dir /dev/shm --json "$OUT/publish-shm.json"
run sidecar python benchmarks/sidecar_bench.py --syncs 10 --json "$OUT/sidecar.json"
run rollout python benchmarks/rollout_bench.py --repeats 30 --steps 10 --json "$OUT/rollout.json"
run sync python benchmarks/sync_bench.py --sizes "$SIZES" --storage local,shm --repeats 2 --json "$OUT/sync.json"
python benchmarks/plot_sync.py "$OUT/sync.json" --out docs/img
