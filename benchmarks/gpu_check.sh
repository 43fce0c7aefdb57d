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
# * SGLang runs as in production: CUDA graphs on (SGLang's default). Before the sync benchmark a
#   graph check starts SGLang on the tiny model, records greedy tokens + logprobs, loads a
#   perturbed checkpoint (the answers must change: graph replays read the new weights) and then
#   the original weights again (the answers must match the first ones), via
#   /update_weights_from_disk as the sidecar does. GPU_CHECK_DEVICE=cpu runs it on the CPU engine.
# * A cast check times 2 GiB of float32 GPU tensors to bfloat16 on the CPU: copy-then-cast vs
#   cast-then-copy (the publisher's way), a publish, and the background snapshot (pinned buffers).
# Outputs (at most 8 files, as the device tool brings back): gpu-check.log (everything printed),
# env.txt (nvidia-smi, Python packages, disks), graph-check.json, sync-<size>.json per size,
# logs.tar.gz (SGLang and sidecar logs).
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

# Greedy logprobs before and after weight loads, with CUDA graphs on (the production path).
cat > "$WORK/graph_check.py" <<'PYEOF'
import json, sys, time
from pathlib import Path

import httpx
import torch

from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.model_dir_source import iter_model_dir_tensors
from rollout_service.sglang_launcher import SGLangServer
from rollout_service.tiny_model import ensure_tiny_model

device, out, logs = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
TOLERANCE = 1e-3
model = ensure_tiny_model(tied=False)
root = logs / "graph-check-ckpts"
prompts = [[5, 6, 7, 8], [100, 200, 300], [17, 18], [9, 10, 11, 12, 13]]
result = {"device": device, "tolerance": TOLERANCE, "passed": False}


def greedy(url):
    r = httpx.post(f"{url}/generate", json={"input_ids": prompts, "return_logprob": True, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}}, timeout=600)
    r.raise_for_status()
    return [([int(t) for t in o["output_ids"]], [float(lp[0]) for lp in o["meta_info"]["output_token_logprobs"]])
            for o in r.json()]


def load(url, step):
    path = root / f"step-{step:08d}"
    r = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(path), "weight_version": str(step)},
                   timeout=600)
    assert r.status_code == 200 and r.json().get("success", True), r.text


perturbed = ((n, t * 0.5 if n.endswith("mlp.down_proj.weight") else t) for n, t in iter_model_dir_tensors(model))
publish_checkpoint(root, 1, perturbed, config=model / "config.json")
publish_checkpoint(root, 2, iter_model_dir_tensors(model), config=model / "config.json")
server = SGLangServer(model, device=device, log_path=logs / "graph-check-sglang.log")
try:
    server.start()
    server.wait_healthy(600, progress_grace_s=120)
    info = httpx.get(f"{server.url}/server_info", timeout=60).json()
    graphs_off = bool(info.get("disable_cuda_graph"))
    result["cuda_graphs"] = "n/a on cpu" if device == "cpu" else ("off" if graphs_off else "on")
    before = greedy(server.url)
    load(server.url, 1)
    changed = greedy(server.url)
    load(server.url, 2)
    after = greedy(server.url)
    diff = max(abs(a - b) for (_, la), (_, lb) in zip(before, after) for a, b in zip(la, lb))
    result.update(
        same_tokens_after_reload=[t for t, _ in before] == [t for t, _ in after],
        max_abs_logprob_diff=diff,
        perturbed_changed_output=[x for x in changed] != [x for x in before],
    )
    result["passed"] = bool(result["same_tokens_after_reload"] and diff <= TOLERANCE
                            and result["perturbed_changed_output"] and result["cuda_graphs"] != "off")
except Exception as exc:
    result["error"] = f"{type(exc).__name__}: {exc}"
finally:
    server.stop()
out.write_text(json.dumps(result, indent=1))
print(f"graph check: {'PASS' if result['passed'] else 'FAIL'} {json.dumps(result)}")
sys.exit(0 if result["passed"] else 1)
PYEOF

if timeout 120 "$PY" -c "import sglang" 2>/dev/null \
        && { [ "$DEVICE" = cpu ] || [[ " ${MODE[*]} " != *" --no-sglang "* ]]; }; then
    say "graph check: greedy logprobs before and after weight loads (CUDA graphs on when on a GPU)"
    timeout -k 30 600 "$PY" "$WORK/graph_check.py" "$DEVICE" "$RESULTS/graph-check.json" "$WORK/logs"
    graph_rc=$?
    say "graph check finished with exit code $graph_rc"
else
    graph_rc=0
    say "graph check skipped: SGLang is not importable with its kernels here"
fi

# Trainer side: cast on the device then copy (what the publisher does) vs copy then cast.
cat > "$WORK/cast_check.py" <<'PYEOF'
import json, sys, tempfile, time
import torch
from trainer_hooks.checkpoint_publisher import CheckpointPublisher

device, gib = sys.argv[1], float(sys.argv[2])
n = int(gib * (1 << 30) / 4 / 16)
tensors = [(f"w{i}", torch.randn(n, device=device)) for i in range(16)]  # float32 on the device
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)


def timed(fn, repeats=3):
    best = float("inf")
    for _ in range(repeats):
        sync(); t0 = time.perf_counter(); fn(); sync(); best = min(best, time.perf_counter() - t0)
    return best


copy_then_cast = timed(lambda: [t.cpu().to(torch.bfloat16) for _, t in tensors])
cast_then_copy = timed(lambda: [t.to(torch.bfloat16).cpu() for _, t in tensors])


class NoWait:
    def notify(self, v): pass
    def wait(self, v, t): pass
    def protected_versions(self): return set()


with tempfile.TemporaryDirectory(dir="/dev/shm" if device == "cuda" else None) as root:
    pub = CheckpointPublisher(root, NoWait(), config={}, dtype="bfloat16", max_shard_bytes=1 << 30, keep=None,
                              sync_timeout_s=60, heartbeat_max_age_s=60)
    t0 = time.perf_counter(); pub.publish_and_wait(1, tensors); publish_s = time.perf_counter() - t0
    snap1 = timed(lambda: pub._snapshot(iter(tensors)), repeats=1)
    snap2 = timed(lambda: pub._snapshot(iter(tensors)), repeats=1)  # pinned buffers reused
print("cast check: " + json.dumps({"device": device, "fp32_gib": round(16 * n * 4 / (1 << 30), 3),
      "copy_then_cast_s": copy_then_cast, "cast_then_copy_s": cast_then_copy,
      "speedup": copy_then_cast / cast_then_copy, "publish_fp32_to_bf16_s": publish_s,
      "background_snapshot_first_s": snap1, "background_snapshot_reused_s": snap2,
      "torch": torch.__version__, "cuda": torch.version.cuda}))
PYEOF
if [ "$DEVICE" = cuda ]; then cast_gib=2; else cast_gib=0.05; fi
timeout -k 10 180 "$PY" "$WORK/cast_check.py" "$DEVICE" "$cast_gib" || say "cast check failed ($?)"

# /dev/shm must hold a raw copy, the naive folder and two checkpoints at once.
shm_fits() {
    local avail; avail=$(df -B1 --output=avail /dev/shm 2>/dev/null | tail -1)
    awk -v a="${avail:-0}" -v s="$1" 'BEGIN { need = (s == "tiny" ? 0.05 : s) * 4.5e9; exit !(a > need) }'
}

status=$(( graph_rc == 0 ? 0 : 1 ))
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
        --log-dir "$WORK/logs" --json "$RESULTS/sync-$size.json"
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
