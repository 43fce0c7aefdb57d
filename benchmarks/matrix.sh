#!/usr/bin/env bash
# The current benchmark matrix of docs/benchmarks.md, most important figures first, on a quiet
# machine (nothing else running: every figure is a time on 2 shared cores).
#
#   benchmarks/matrix.sh TAG            # e.g. benchmarks/matrix.sh session18
#
# Each command writes its own JSON (and its printed tables, .txt) under docs/results/ with TAG
# in the name, and its log under benchmarks/results/matrix-TAG/; a command that fails is
# reported and the next one runs. In order:
#   1. 1 GB end to end on sshfs with the /generate probe: delta vs full vs both physical limits,
#      SGLang's pause against an idle baseline       sync-delta-1gb-sshfs-probe-TAG.json
#   2. delta_bench, trainer + sidecar side without SGLang, 0.5 / 1 / 2 GB x lr 1e-6 / 1e-5 x
#      local / shm / sshfs (2 GB: stage on local disk, two 2 GB stages do not fit in /dev/shm
#      beside the rest)                              delta-bench-{0.5,1,2}gb-TAG.json
#   3. 2 GB end to end on sshfs, SGLang idle (--no-probe, as sessions 9 and 11 measured it),
#      stage on local disk                           sync-delta-2gb-sshfs-TAG.json
#   4. 0.5 GB end to end on local disk and /dev/shm with the probe
#                                                    sync-delta-0.5gb-local-shm-probe-TAG.json
# Every sync_bench run: medians of 3 runs per path, full and delta alternating run by run, each
# run with 2 untimed syncs first (the stage then holds a spare, as in steady state), 3 AdamW
# warm-up steps, lr 1e-6; every delta_bench cell: the same version pair, 3 repeats after an
# untimed round, order alternating.
#
# Estimated run time: about 1 hour (45-75 min) on the 2-core, 24 GB VM with nothing else running:
# ~9 min for 1, ~4 + 8 + 16 min for 2 (0.5, 1, 2 GB; sshfs's full writes and read-backs are
# most of it), ~14 min for 3, ~5 min for 4. Scaled from the 0.05 GB smoke runs (delta_bench,
# local + shm, 3 repeats: 37 s; sync_bench --delta, shm, 2 repeats with the probe: 89 s, of which
# ~40 s starting SGLang) and the per-sync times of docs/benchmarks.md (sshfs writes at
# 0.15-0.2 GB/s and reads back at ~0.2 GB/s here). The first run also builds the 0.5, 1 and 2 GB
# benchmark models (~1-3 min each, cached in ~/.cache/rollout-service/bench-models).
#
# MATRIX_DRY_RUN=1 prints the commands without running them.
# MATRIX_MAX_LOAD=N (optional): before each command, wait until the 1-minute load average is
# below N (at most MATRIX_WAIT_S seconds, default 1800, then run anyway and say so).
set -uo pipefail

TAG="${1:?usage: benchmarks/matrix.sh TAG   (e.g. session18: names the JSON under docs/results/)}"
case "$TAG" in *[!A-Za-z0-9._-]*) echo "TAG may hold letters, digits, '.', '_' and '-' only" >&2; exit 2 ;; esac
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
RESULTS=docs/results
LOGS="benchmarks/results/matrix-$TAG"
mkdir -p "$RESULTS" "$LOGS"
STAGE_ON_DISK="$HOME/.cache/rollout-service"
START=$(date +%s)
FAILED=()

say() { echo "[matrix $TAG +$(( ($(date +%s) - START) / 60 ))m$(( ($(date +%s) - START) % 60 ))s] $*"; }
load1() { cut -d' ' -f1 /proc/loadavg; }

wait_quiet() {
    [ -n "${MATRIX_MAX_LOAD:-}" ] || return 0
    local waited=0 limit="${MATRIX_WAIT_S:-1800}"
    while awk -v l="$(load1)" -v m="$MATRIX_MAX_LOAD" 'BEGIN { exit !(l >= m) }'; do
        if [ "$waited" -ge "$limit" ]; then
            say "load $(load1) still >= $MATRIX_MAX_LOAD after ${waited}s: running anyway"
            return 0
        fi
        [ $(( waited % 60 )) -eq 0 ] && say "waiting for load $(load1) < $MATRIX_MAX_LOAD"
        sleep 10
        waited=$(( waited + 10 ))
    done
}

# step NAME COMMAND...: the command's tables to docs/results/NAME.txt, its log to $LOGS/NAME.log.
step() {
    local name=$1; shift
    if [ -n "${MATRIX_DRY_RUN:-}" ]; then echo "./scripts/run.sh $*"; return 0; fi
    wait_quiet
    say "== $name (load $(load1)): $*"
    local t0=$(date +%s)
    # The whole log to the file; its progress lines (each timed run) to the terminal too.
    "$REPO/scripts/run.sh" "$@" > "$RESULTS/$name.txt" \
        2> >(tee "$LOGS/$name.log" | grep --line-buffered -E '^(== size|-- size|  repeat|  [0-9.]+G lr)' >&2)
    local rc=$?
    sleep 1  # the log's last lines
    if [ "$rc" -eq 0 ]; then
        say "   $name done in $(( $(date +%s) - t0 ))s -> $RESULTS/$name.json, $RESULTS/$name.txt"
    else
        FAILED+=("$name (exit $rc)")
        say "   $name FAILED (exit $rc) after $(( $(date +%s) - t0 ))s; last lines of $LOGS/$name.log:"
        tail -n 15 "$LOGS/$name.log" | sed 's/^/      /'
    fi
}

SYNC=(python benchmarks/sync_bench.py --delta --skip-naive --repeats 3 --log-dir "$LOGS/sync-logs")
DELTA=(python benchmarks/delta_bench.py --lrs 1e-6,1e-5 --storage local,shm,sshfs --repeats 3)

say "start; $(nproc) cores, $(free -g | awk '/^Mem:/ { print $2 " GB RAM, " $7 " GB available" }'), load $(load1)"

name="sync-delta-1gb-sshfs-probe-$TAG"
step "$name" "${SYNC[@]}" --sizes 1 --storage sshfs --json "$RESULTS/$name.json"

for size in 0.5 1 2; do
    name="delta-bench-${size}gb-$TAG"
    stage=()
    [ "$size" = 2 ] && stage=(--stage-root "$STAGE_ON_DISK/delta-bench-stage")
    step "$name" "${DELTA[@]}" --sizes "$size" "${stage[@]}" --json "$RESULTS/$name.json"
done

name="sync-delta-2gb-sshfs-$TAG"
step "$name" "${SYNC[@]}" --sizes 2 --storage sshfs --no-probe --stage-dir "$STAGE_ON_DISK/sync-bench-stage" \
    --json "$RESULTS/$name.json"

name="sync-delta-0.5gb-local-shm-probe-$TAG"
step "$name" "${SYNC[@]}" --sizes 0.5 --storage local,shm --json "$RESULTS/$name.json"

if [ "${#FAILED[@]}" -eq 0 ]; then
    say "all done in $(( ($(date +%s) - START) / 60 )) min; JSON and tables in $RESULTS/*-$TAG.*"
else
    say "done in $(( ($(date +%s) - START) / 60 )) min; FAILED: ${FAILED[*]} (logs in $LOGS/)"
    exit 1
fi
