#!/usr/bin/env bash
# Delta sync at 7B size on a GPU machine, trainer side and sidecar side, without SGLang: one
# prepared, time-boxed script for a lent GPU (issue #12's "encode from GPU memory and apply at
# 7B size").
#
#   bash benchmarks/gpu_delta_check.sh      # results in $OUT if set, else ./gpu-results
#
# Runs benchmarks/delta_bench.py --device cuda for each size in GPU_DELTA_SIZES (default "1 15";
# 15 GB is Qwen2-7B's bf16 size), lr 1e-6: fp32 master weights and AdamW on the GPU, each
# version cast to bf16 on the GPU and encoded part by part from GPU memory on the host's
# threads, written to local disk, rebuilt and verified in a stage in /dev/shm (on disk when
# /dev/shm lacks 3x the model), beside a full publish + verified stage copy of the same version.
# Each size runs under `timeout` within GPU_DELTA_BUDGET_S (default 420 s), with
# GPU_DELTA_REPEATS timed rounds (default 1, to fit the budget; delta_bench.py's own default is 3).
#
# Needs torch with CUDA, numpy, safetensors and xxhash (the device image has them) and
# zstandard (it does not): carry its wheel. Once, here, in the repo's root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       "zstandard==$(sed -n 's/^zstandard==//p' requirements/cpu.lock)"
# then call the device tool with carry [".whl"]; this script installs .whl/*.whl into /tmp/site
# when zstandard is missing. Memory at 15 GB: ~105 GB of GPU memory (fp32 weights, AdamW's two
# states, a bf16 copy to count changed elements), ~15 GB of host RAM (the writer's held copy)
# plus the stage (45 GB in /dev/shm), ~45 GB of disk.
# Outputs: gpu-delta-check.log, env.txt, delta-<size>.json.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS="${OUT:-$REPO/gpu-results}"
BUDGET_S="${GPU_DELTA_BUDGET_S:-420}"
SIZES="${GPU_DELTA_SIZES:-1 15}"
DEVICE="${GPU_DELTA_DEVICE:-cuda}"   # "cpu" only to dry-run this script on a machine without a GPU
START=$(date +%s)
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-delta-XXXXXX")"
mkdir -p "$RESULTS"
exec > >(tee -a "$RESULTS/gpu-delta-check.log") 2>&1
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
say() { echo "[gpu_delta_check +$(( $(date +%s) - START ))s] $*"; }

PY="${ROLLOUT_GPU_PYTHON:-$(command -v python3)}"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$REPO"
if ! "$PY" -c "import zstandard" 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            && export PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi
    "$PY" -c "import zstandard" || { say "zstandard is missing: carry its wheel (see this script's header)"; exit 2; }
fi
{
    echo "== nvidia-smi"; timeout 30 nvidia-smi || echo "nvidia-smi failed ($?)"
    echo "== cpus: $(nproc)"; free -g; df -h /dev/shm "$WORK"
    "$PY" -c "import torch, zstandard, xxhash, numpy; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'zstandard', zstandard.__version__, 'xxhash', xxhash.VERSION, 'numpy', numpy.__version__)"
} > "$RESULTS/env.txt" 2>&1
cat "$RESULTS/env.txt"

# Room, in KiB, for N copies of a model of GB gigabytes (the checkpoint root holds version 1 in
# full, version 2 in full and the raw write limit's file; the stage holds the base and a spare,
# which each new version is written over, and beside them the limit's write of the model).
copies_kb() { awk -v gb="$1" -v n="$2" 'BEGIN { printf "%d", gb * n * 1.07 * 1024 * 1024 }'; }
avail_kb() { df -k --output=avail "$1" | tail -1; }
for size in $SIZES; do
    stage=/dev/shm disk_copies=3
    if [ "$(avail_kb /dev/shm)" -lt "$(copies_kb "$size" 3)" ]; then stage="$WORK/stage" disk_copies=6; fi
    if [ "$(avail_kb "$WORK")" -lt "$(copies_kb "$size" "$disk_copies")" ]; then
        say "size $size skipped: $disk_copies copies do not fit on the disk of $WORK (stage in $stage)"; continue
    fi
    t=$(( $(left) - 10 ))
    if [ "$t" -lt 60 ]; then say "size $size skipped: ${t}s left"; continue; fi
    say "size $size GB, stage in $stage, ${t}s left"
    mkdir -p "$WORK/ckpt" "$stage"
    timeout "$t" "$PY" benchmarks/delta_bench.py --device "$DEVICE" --sizes "$size" --lrs 1e-6 \
        --storage "$WORK/ckpt" --stage-root "$stage" --repeats "${GPU_DELTA_REPEATS:-1}" \
        --json "$RESULTS/delta-$size.json" \
        || say "size $size failed or timed out (exit $?)"
    # A run stopped by timeout skips its own clean-up: its stage would hold tmpfs memory.
    rm -rf "$WORK/ckpt" "$WORK/stage" "$stage"/delta-bench-stage-* "$stage"/.bench-stage-write-*
done
rm -rf "$WORK"
say "done"
exec >&- 2>&-
wait  # for tee to write the log's last lines
