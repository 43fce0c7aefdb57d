#!/usr/bin/env bash
# The sync benchmark with SGLang on one GPU, as one prepared, time-boxed script.
#
#   bash benchmarks/gpu_check.sh            # results in $OUT if set, else ./gpu-results
#
# Runs benchmarks/sync_bench.py --device cuda (storage: local disk and /dev/shm) one model size
# at a time (tiny, 2, 1, 0.5 GB), each under `timeout`, skipping the sizes that no longer fit in
# the budget (GPU_CHECK_BUDGET_S, default 480 s = 8 minutes, model building included).
#
# Assumptions (the machine has no network, so nothing is installed here):
# * Python: $ROLLOUT_GPU_PYTHON if set, else .venv-gpu/bin/python in this checkout if it was
#   carried along or built there earlier, else `python3` on PATH. This checkout is put on
#   PYTHONPATH, so the project itself needs no install.
# * The full run needs, in that Python: torch with CUDA, transformers, safetensors, xxhash,
#   httpx, and SGLang 0.5.23 *with its CUDA kernels* (sglang-kernel, flashinfer) plus the
#   sidecar's fastapi, uvicorn and watchdog. A stock CUDA image has torch and transformers but
#   no SGLang; then the script says so and measures the trainer side only (--no-sglang: publish
#   from GPU tensors, raw write + fsync limit, save_pretrained), which needs no SGLang.
# * If the first size (tiny) fails with SGLang, the remaining sizes also fall back to --no-sglang.
# Outputs (at most 8 files, as the device tool brings back): gpu-check.log (everything printed),
# env.txt (nvidia-smi, Python packages, disks), sync-<size>.json per size, logs.tar.gz (SGLang
# and sidecar logs).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS="${OUT:-$REPO/gpu-results}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-480}"
SIZES="${GPU_CHECK_SIZES:-tiny 2 1 0.5}"
REPEATS="${GPU_CHECK_REPEATS:-3}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"   # "cpu" only to dry-run this script on a machine without a GPU
RESERVE_S=20          # kept back for packing the logs
MIN_SIZE_S=75         # a size is not started with less than this left
START=$(date +%s)
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check-XXXXXX")"
mkdir -p "$RESULTS" "$WORK/logs"
exec > >(tee -a "$RESULTS/gpu-check.log") 2>&1

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
say() { echo "[gpu_check +$(( $(date +%s) - START ))s] $*"; }

if [ -n "${ROLLOUT_GPU_PYTHON:-}" ]; then PY="$ROLLOUT_GPU_PYTHON"
elif [ -x "$REPO/.venv-gpu/bin/python" ]; then PY="$REPO/.venv-gpu/bin/python"
else PY="$(command -v python3 || true)"; fi
if [ -z "$PY" ]; then say "no Python found (set ROLLOUT_GPU_PYTHON)"; exit 2; fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$REPO"
say "repo $REPO, python $PY, results $RESULTS, budget ${BUDGET_S}s, sizes: $SIZES"

{
    echo "== nvidia-smi"; timeout 30 nvidia-smi || echo "nvidia-smi failed ($?)"
    echo "== python packages"
    timeout 60 "$PY" -m pip list 2>/dev/null | grep -iE "^(torch|transformers|safetensors|xxhash|httpx|sglang|sgl|flashinfer|fastapi|uvicorn|watchdog|tokenizers) " \
        || echo "pip list failed"
    echo "== disks"; df -h "$REPO" /dev/shm 2>&1
    echo "== cpus $(nproc), memory"; free -g 2>&1
} > "$RESULTS/env.txt" 2>&1
cat "$RESULTS/env.txt"

if [ "$DEVICE" = cuda ] && ! timeout 120 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    say "torch does not see a CUDA device here: nothing to measure"; exit 2
fi
MODE=(--device "$DEVICE")
if timeout 180 "$PY" -c "import sglang, sgl_kernel, flashinfer, fastapi, uvicorn, watchdog, xxhash, httpx, transformers" \
        && timeout 120 "$PY" -m rollout_service.cli sidecar --help >/dev/null; then
    say "SGLang with CUDA kernels and the sidecar's packages import: full run"
else
    say "SGLang (with CUDA kernels) or the sidecar's packages are missing: trainer side only (--no-sglang)"
    MODE+=(--no-sglang)
fi

# /dev/shm must hold a raw copy, the naive folder and two checkpoints at once.
shm_fits() {
    local avail; avail=$(df -B1 --output=avail /dev/shm 2>/dev/null | tail -1)
    awk -v a="${avail:-0}" -v s="$1" 'BEGIN { need = (s == "tiny" ? 0.05 : s) * 4.5e9; exit !(a > need) }'
}

status=0
for size in $SIZES; do
    remaining=$(( $(left) - RESERVE_S ))
    if [ "$remaining" -lt "$MIN_SIZE_S" ]; then
        say "skipping size $size: ${remaining}s left"; continue
    fi
    storage="local"
    if shm_fits "$size"; then storage="local,shm"; else say "/dev/shm too small for $size GB: local disk only"; fi
    say "size $size (${MODE[*]}, storage $storage), timeout ${remaining}s"
    timeout -k 30 "$remaining" "$PY" benchmarks/sync_bench.py "${MODE[@]}" --sizes "$size" \
        --storage "$storage" --repeats "$REPEATS" --warmup 1 --startup-timeout 300 --sync-timeout 300 \
        --sglang-args="--disable-cuda-graph" --log-dir "$WORK/logs" --json "$RESULTS/sync-$size.json"
    rc=$?
    say "size $size finished with exit code $rc"
    if [ "$rc" -ne 0 ]; then
        status=1
        if [ "$size" = tiny ] && [[ " ${MODE[*]} " != *" --no-sglang "* ]]; then
            say "the tiny model failed with SGLang on the GPU: the other sizes run trainer side only"
            MODE+=(--no-sglang)
        fi
    fi
done

timeout 60 tar -czf "$RESULTS/logs.tar.gz" -C "$WORK" logs 2>/dev/null || say "could not pack the logs"
rm -rf "$WORK"
say "done in $(( $(date +%s) - START ))s; results in $RESULTS"
exit "$status"
