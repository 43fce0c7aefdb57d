"""Delta sync vs full sync on realistic updates: bytes, encode, write, apply, side by side.

For each model size (Qwen2-architecture tensor shapes, bf16 published, fp32 master weights
stepped by AdamW with random gradients after ``--warmup-steps`` steps: Adam's step does not
depend on the gradient's scale, so the update sizes are realistic) and learning rate, one
version pair (1 -> 2) is made once, and on each storage both paths sync version 2, rebuilding
or copying it into a node-local stage (``--stage-root``, default /dev/shm):

- ``full``: today's path, the whole model written (``publish_checkpoint``), then copied and
  verified into the stage (what the sidecar does before SGLang loads it);
- ``delta``: XOR + zstd against version 1 (``DeltaCheckpointWriter``; a fresh writer publishes
  version 1 in full first, untimed), then applied to the staged version 1 and verified;
- limits (``measures.py``): the full bytes written + fsync'd alone (the storage's own speed),
  the delta's bytes likewise, and each path's physical limit: its bytes written + fsync'd, read
  back, and one write of the model over existing pages in the stage's file system.

Fair by construction: the same version pair on every storage and in every repeat; both paths
start from the same stage (version 1 served and a spare copy, which the new copy or rebuild
writes over, as a sidecar's stage in steady state); one untimed round first, then
``--repeats`` rounds (default 3) in alternating order (delta first, full first, ...); medians,
with every sample in the JSON.

Prints the changed fraction, bytes written per sync (delta / full), encode and apply
throughput, publish + stage times with ratios, and the limits. SGLang's own load from the
stage is the same for both kinds (it reads the same full files); ``sync_bench.py`` measures it.

    ./scripts/run.sh python benchmarks/delta_bench.py --sizes 0.5,1 --lrs 1e-6,1e-5 \\
        --storage local,shm,sshfs

``--auto-versions N`` instead syncs N versions three ways side by side (always delta, always
full, and ``auto``: the writer's measured choice, ``rollout_service/delta_choice.py``).

``--device cuda`` keeps the master weights and AdamW on the GPU: the encode then copies each
part from GPU memory (cast to bf16 there first, as the trainer does); ``gpu_delta_check.sh``
runs it at 7B size on a GPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))

import measures  # noqa: E402
from model_factory import plan_bench_model  # noqa: E402

from rollout_service.checkpoint_format import DEFAULT_FULL_EVERY, Manifest, step_dir_name  # noqa: E402
from rollout_service.checkpoint_writer import publish_checkpoint  # noqa: E402
from rollout_service.delta_choice import PublishCosts  # noqa: E402
from rollout_service.delta_writer import DeltaCheckpointWriter  # noqa: E402
from rollout_service.sidecar.staging import SPARE_PREFIX, Stage  # noqa: E402
from rollout_service.untrusted_files import Deadline  # noqa: E402

STORAGE_ALIASES = {"local": Path("~/.cache/rollout-service/delta-bench"), "shm": Path("/dev/shm")}
CONFIG = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}


def qwen2_state(gb: float, seed: int = 0, device: str = "cpu") -> dict[str, torch.nn.Parameter]:
    """fp32 parameters with the tensor names and shapes of a Qwen2 model of about ``gb`` GB in
    bf16, made on ``device`` (a GPU's trainer holds its master weights there)."""
    spec = plan_bench_model(gb, vocab_size=151936 if gb >= 0.5 else 32000, seed=seed)
    s = spec.shape
    head_dim = s.hidden // s.heads
    kv = s.kv_heads * head_dim
    g = torch.Generator(device=device).manual_seed(seed)

    def p(*shape: int) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.randn(*shape, generator=g, device=device) * 0.02)

    def ones(n: int) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.ones(n, device=device))

    state = {"model.embed_tokens.weight": p(spec.vocab_size, s.hidden)}
    for i in range(spec.num_layers):
        pre = f"model.layers.{i}."
        state.update(
            {
                pre + "self_attn.q_proj.weight": p(s.hidden, s.hidden),
                pre + "self_attn.q_proj.bias": p(s.hidden),
                pre + "self_attn.k_proj.weight": p(kv, s.hidden),
                pre + "self_attn.k_proj.bias": p(kv),
                pre + "self_attn.v_proj.weight": p(kv, s.hidden),
                pre + "self_attn.v_proj.bias": p(kv),
                pre + "self_attn.o_proj.weight": p(s.hidden, s.hidden),
                pre + "mlp.gate_proj.weight": p(s.intermediate, s.hidden),
                pre + "mlp.up_proj.weight": p(s.intermediate, s.hidden),
                pre + "mlp.down_proj.weight": p(s.hidden, s.intermediate),
                pre + "input_layernorm.weight": ones(s.hidden),
                pre + "post_attention_layernorm.weight": ones(s.hidden),
            }
        )
    state["model.norm.weight"] = ones(s.hidden)
    state["lm_head.weight"] = p(spec.vocab_size, s.hidden)
    return state


def adam_step(opt: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter], g: torch.Generator) -> None:
    """One AdamW step of every parameter, one parameter at a time (the optimizer skips those
    without a gradient; each one's state is its own, so this is the same step): one tensor's
    gradient in memory at a time, not a model's (2 GB models fit in 24 GB with it)."""
    for t in params.values():
        t.grad = torch.randn(t.shape, generator=g, device=t.device)
        opt.step()
        t.grad = None
    if next(iter(params.values())).is_cuda:
        torch.cuda.synchronize()  # the step is done before any timer starts


def published(params: dict[str, torch.nn.Parameter]) -> Iterator[tuple[str, torch.Tensor]]:
    """What the trainer hands the writer: GPU weights cast to bf16 where they are, one tensor at
    a time, before any copy to the host (``trainer_hooks.checkpoint_publisher.cast_on_device``;
    not imported: that package needs TRL, which a bare GPU image lacks); CPU ones as they are."""
    return ((k, t.detach().to(torch.bfloat16) if t.is_cuda else t) for k, t in params.items())


def changed_fraction(before: dict[str, torch.Tensor], params: dict[str, torch.nn.Parameter]) -> float:
    changed = total = 0
    for k, t in params.items():
        now = t.detach().to(torch.bfloat16)
        changed += int((now.view(torch.int16) != before[k].view(torch.int16)).sum())
        total += now.numel()
    return changed / total


def make_versions(
    gb: float, lr: float, warmup_steps: int, device: str = "cpu"
) -> tuple[dict[str, torch.Tensor], dict[str, torch.nn.Parameter], float]:
    """The version pair every storage and repeat syncs: (version 1 as the bf16 tensors the
    trainer publishes, the fp32 master weights one AdamW step later = version 2, the share of
    bf16 elements that changed). AdamW's states are dropped once version 2 is made (two fp32
    copies of the model: a 2 GB model's pair then fits beside two stages in 24 GB)."""
    params = qwen2_state(gb, device=device)
    opt = torch.optim.AdamW(params.values(), lr=lr)
    g = torch.Generator(device=device).manual_seed(1)
    for _ in range(warmup_steps):  # Adam's first steps move every weight by lr: not the steady state
        adam_step(opt, params, g)
    v1 = {k: t.detach().to(torch.bfloat16) for k, t in params.items()}
    adam_step(opt, params, g)
    del opt
    gc.collect()
    return v1, params, changed_fraction(v1, params)


def has_spare(stage_dir: Path) -> bool:
    """Whether the stage holds a spare copy (that the next copy or rebuild writes over)."""
    return any(p.name.startswith(SPARE_PREFIX) for p in stage_dir.iterdir())


def sync_pair(
    rep: int,
    order: tuple[str, ...],
    v1: dict[str, torch.Tensor],
    params: dict[str, torch.nn.Parameter],
    work: Path,
    stage: Stage,
    stage_dir: Path,
) -> dict:
    """Both paths sync version 2 once, in ``order``, from the same stage state: version 1 staged
    (served) and a spare (the copy before it, or the other path's last copy). A fresh writer
    publishes version 1 in full first (untimed), so that each repeat encodes the same delta."""
    s1, s2 = 2 * rep + 1, 2 * rep + 2  # new step numbers per repeat: no staged copy is reused
    droot, froot = work / f"delta-{rep}", work / f"full-{rep}"
    writer = DeltaCheckpointWriter(full_every=1000)
    out: dict = {"order": "/".join(order)}
    try:
        writer.publish(droot, s1, published(v1), config=CONFIG, dtype="bfloat16", run_id="bench")
        served = stage.build(droot, droot / step_dir_name(s1), Manifest.load(droot / step_dir_name(s1)), Deadline(None))
        stage.prune({served.path})  # the copy served before becomes the spare
        for kind in order:
            out[f"{kind}_spare"] = has_spare(stage_dir)
            if kind == "delta":
                t0 = time.perf_counter()
                writer.absorb(published(params), dtype="bfloat16")
                out["encode_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                delta = writer.write(droot, s2, config=CONFIG, run_id="bench")
                out["delta_write_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                path = droot / step_dir_name(s2)
                stage.build(droot, path, Manifest.load(path), Deadline(None))
                out["apply_s"] = time.perf_counter() - t0
                out.update(kind=delta.kind, delta_bytes=delta.total_bytes)
            else:
                t0 = time.perf_counter()
                full = publish_checkpoint(froot, s2, published(params), config=CONFIG, dtype="bfloat16", run_id="bench")
                out["full_publish_s"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                path = froot / step_dir_name(s2)
                stage.build(froot, path, Manifest.load(path), Deadline(None))
                out["full_stage_s"] = time.perf_counter() - t0
                out["full_bytes"] = full.total_bytes
            # SGLang would load the new copy; here version 1 stays the served one and the new
            # copy becomes the spare, so the other path finds the stage as this one did.
            stage.prune({served.path})
    finally:
        writer.close()
        shutil.rmtree(froot, ignore_errors=True)
        shutil.rmtree(droot, ignore_errors=True)
    out["delta_sync_s"] = out["encode_s"] + out["delta_write_s"] + out["apply_s"]
    out["full_sync_s"] = out["full_publish_s"] + out["full_stage_s"]
    return out


def limits(work: Path, stage_root: Path, full_bytes: int, delta_bytes: int) -> dict[str, float]:
    """Both paths' physical limits (``measures.py``): the bytes written + fsync'd to the storage
    and read back, then one write of the model over existing pages in the stage's file system
    (a full sync's copy into the stage, a delta's rebuild: either writes every byte there)."""
    out: dict[str, float] = {}
    for kind, nbytes in (("full", full_bytes), ("delta", delta_bytes)):
        path = work / f"limit-{kind}"
        try:
            out[f"limit_{kind}_write_s"] = measures.write_fsync(path, nbytes)
            out[f"limit_{kind}_read_s"] = measures.read_back(path)["read_s"]
        finally:
            path.unlink(missing_ok=True)
    out["limit_stage_write_s"] = measures.stage_write(stage_root, full_bytes)
    for kind in ("full", "delta"):
        out[f"limit_{kind}_s"] = out[f"limit_{kind}_write_s"] + out[f"limit_{kind}_read_s"] + out["limit_stage_write_s"]
    return out


def run(
    gb: float,
    lr: float,
    storages: list[tuple[str, Path]],
    stage_root: Path,
    warmup_steps: int,
    device: str = "cpu",
    repeats: int = 3,
) -> list[dict]:
    """One row per storage: the same version pair synced both ways ``repeats`` times (after one
    untimed round), the order alternating (delta first, then full first, ...), medians."""
    v1, params, fraction = make_versions(gb, lr, warmup_steps, device)
    rows = []
    for label, base in storages:
        work = Path(tempfile.mkdtemp(prefix=f"delta-bench-{Path(label).name}-", dir=base))
        stage_dir = Path(tempfile.mkdtemp(prefix="delta-bench-stage-", dir=stage_root))
        try:
            stage = Stage(stage_dir)
            samples = []
            # Round -1 is untimed: first-call costs (thread pools, scratch buffers), and it leaves
            # the stage a spare, which every timed round then starts with.
            for rep in range(-1, repeats):
                order = ("delta", "full") if rep % 2 == 0 else ("full", "delta")
                sample = sync_pair(rep + 1, order, v1, params, work, stage, stage_dir)
                if rep < 0:
                    continue
                sample.update(limits(work, stage_root, sample["full_bytes"], sample["delta_bytes"]))
                samples.append(sample)
                print(
                    f"  {gb}G lr {lr:g} {label} repeat {rep + 1} ({sample['order']}):"
                    f" delta {sample['delta_sync_s']:.3f} s, full {sample['full_sync_s']:.3f} s,"
                    f" limits {sample['limit_delta_s']:.3f} / {sample['limit_full_s']:.3f} s",
                    file=sys.stderr,
                    flush=True,
                )
            stage.close()
            rows.append(summarise(gb, lr, label, device, fraction, samples))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "samples"}), file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(stage_dir, ignore_errors=True)
    return rows


def summarise(gb: float, lr: float, label: str, device: str, fraction: float, samples: list[dict]) -> dict:
    """One storage's row: the median of each figure over the repeats (every sample kept)."""

    def med(key: str) -> float:
        return statistics.median(s[key] for s in samples)

    full_bytes, delta_bytes = samples[0]["full_bytes"], samples[0]["delta_bytes"]
    row = {
        "size_gb": gb,
        "lr": lr,
        "storage": label,
        "device": device,
        "repeats": len(samples),
        "changed_fraction": fraction,
        "kind": samples[0]["kind"],
        "full_bytes": full_bytes,
        "delta_bytes": delta_bytes,
        "bytes_ratio": delta_bytes / full_bytes,
        "spare_every_time": all(s["delta_spare"] and s["full_spare"] for s in samples),
    }
    keys = ("encode_s", "delta_write_s", "apply_s", "full_publish_s", "full_stage_s", "delta_sync_s", "full_sync_s")
    keys += tuple(k for k in samples[0] if k.startswith("limit_"))
    row.update({k: med(k) for k in keys})
    row.update(
        encode_gbps=full_bytes / row["encode_s"] / 1e9,
        apply_gbps=full_bytes / row["apply_s"] / 1e9,
        storage_write_gbps=full_bytes / row["limit_full_write_s"] / 1e9,
        sync_ratio=row["delta_sync_s"] / row["full_sync_s"],
        delta_vs_limit=row["delta_sync_s"] / row["limit_delta_s"],
        full_vs_limit=row["full_sync_s"] / row["limit_full_s"],
        samples=samples,
    )
    return row


def run_auto(gb: float, lr: float, storages: list[tuple[str, Path]], stage_root: Path, versions: int) -> list[dict]:
    """The same ``versions`` AdamW versions synced three ways on each storage, side by side:
    always a delta, always full, and ``auto`` (``PublishCosts``: the kind measured faster).
    Each sync = publish + the sidecar's stage build (copy or rebuild, verified)."""
    params = qwen2_state(gb)
    opt = torch.optim.AdamW(params.values(), lr=lr)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        adam_step(opt, params, g)
    rows = []
    for label, base in storages:
        work = Path(tempfile.mkdtemp(prefix=f"delta-bench-auto-{label}-", dir=base))
        stages = {m: Path(tempfile.mkdtemp(prefix=f"delta-bench-stage-{m}-", dir=stage_root)) for m in MODES}
        try:
            writers = {
                "delta": DeltaCheckpointWriter(full_every=1000),
                "auto": DeltaCheckpointWriter(full_every=1000, costs=PublishCosts(probe_every=DEFAULT_FULL_EVERY)),
            }
            stage = {m: Stage(d) for m, d in stages.items()}
            seconds = {m: 0.0 for m in MODES}
            kinds: list[str] = []
            for version in range(1, versions + 1):
                for mode in MODES:
                    root = work / mode
                    t0 = time.perf_counter()
                    if mode == "full":
                        publish_checkpoint(root, version, params.items(), config=CONFIG, dtype="bfloat16", run_id="b")
                    else:
                        kind = (
                            writers[mode]
                            .publish(root, version, params.items(), config=CONFIG, dtype="bfloat16", run_id="b")
                            .kind
                        )
                        if mode == "auto":
                            kinds.append(kind)
                    path = root / step_dir_name(version)
                    built = stage[mode].build(root, path, Manifest.load(path), Deadline(None))
                    stage[mode].prune({built.path})
                    if version > 1:  # version 1 is full in every mode
                        seconds[mode] += time.perf_counter() - t0
                adam_step(opt, params, g)
            for m in MODES:
                stage[m].close()
            for w in writers.values():
                w.close()
            row = {
                "size_gb": gb,
                "lr": lr,
                "storage": label,
                "versions": versions,
                "auto_kinds": "".join(k[0].upper() for k in kinds),
                **{f"{m}_sync_s": seconds[m] / (versions - 1) for m in MODES},
                "auto_s_per_gb": writers["auto"].costs.s_per_gb if writers["auto"].costs else {},
            }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            for d in stages.values():
                shutil.rmtree(d, ignore_errors=True)
    return rows


MODES = ("delta", "full", "auto")


def print_auto_table(rows: list[dict]) -> None:
    head = f"{'size':>5} {'lr':>6} {'storage':>7} {'delta':>7} {'full':>7} {'auto':>7} {'auto/best':>9}  auto's kinds"
    print(head)
    print("-" * len(head))
    for r in rows:
        best = min(r["delta_sync_s"], r["full_sync_s"])
        print(
            f"{r['size_gb']:>4}G {r['lr']:>6.0e} {r['storage']:>7} {r['delta_sync_s']:>6.2f}s {r['full_sync_s']:>6.2f}s"
            f" {r['auto_sync_s']:>6.2f}s {r['auto_sync_s'] / best:>8.2f}x  {r['auto_kinds']}"
        )
    print(
        "\nmean seconds per sync (publish + the stage's verified copy or rebuild) over versions 2..N of the"
        " same AdamW run; auto = checkpoint_delta's default (the kind measured faster, a delta probe every"
        f" {DEFAULT_FULL_EVERY} versions); kinds: F full, D delta."
    )


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'size':>5} {'lr':>6} {'storage':>7} {'changed':>8} {'bytes d/f':>9} {'encode':>8}"
        f" {'storage w':>9} {'apply':>8} {'delta sync':>10} {'full sync':>9} {'ratio':>6}"
        f" {'d.write':>8} {'d.limit':>8} {'f.limit':>8} {'d/d.lim':>8} {'f/f.lim':>8} {'spare':>5}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['size_gb']:>4}G {r['lr']:>6.0e} {r['storage']:>7} {100 * r['changed_fraction']:>7.2f}%"
            f" {100 * r['bytes_ratio']:>8.2f}% {r['encode_gbps']:>5.2f}GB/s {r['storage_write_gbps']:>6.2f}GB/s"
            f" {r['apply_gbps']:>5.2f}GB/s {r['delta_sync_s']:>9.2f}s {r['full_sync_s']:>8.2f}s"
            f" {r['sync_ratio']:>6.3f} {r['limit_delta_write_s']:>7.3f}s {r['limit_delta_s']:>7.2f}s"
            f" {r['limit_full_s']:>7.2f}s {r['delta_vs_limit']:>7.2f}x {r['full_vs_limit']:>7.2f}x"
            f" {'yes' if r['spare_every_time'] else 'no':>5}"
        )
    print(
        "\nmedians of each figure over the repeats (the same version pair each time, delta and full in"
        " alternating order, both staged over a spare copy: spare = yes when every timed copy and"
        " rebuild had one). changed: bf16 elements that differ from the previous version; bytes d/f:"
        " delta bytes / full bytes; encode: full bytes / (XOR + zstd) time; storage w: one sequential"
        " write + fsync of the full bytes; apply: full bytes / (rebuild + verify in the stage) time;"
        " delta sync = encode + write + apply; full sync = full publish + stage copy (both without"
        " SGLang's load, which is the same for both); ratio = delta sync / full sync; d.write: the"
        " delta's bytes written + fsync'd alone; d.limit, f.limit: each path's physical limit, its"
        " bytes written + fsync'd, read back, and one write of the model into the stage's file system."
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="0.5,1", help="bf16 model sizes in GB (default 0.5,1)")
    ap.add_argument("--lrs", default="1e-6,1e-5", help="AdamW learning rates (default 1e-6,1e-5)")
    ap.add_argument(
        "--storage",
        default="local,shm",
        help="where checkpoints are written: local, shm, sshfs (a real network file system"
        " over loopback), or a directory (default local,shm)",
    )
    ap.add_argument("--stage-root", default="/dev/shm", help="node-local folder for the stage (default /dev/shm)")
    ap.add_argument(
        "--warmup-steps",
        type=int,
        default=3,
        help="AdamW steps before the first published version (default 3: Adam's first steps move every weight by lr)",
    )
    ap.add_argument(
        "--auto-versions",
        type=int,
        default=0,
        help="instead: sync this many versions three ways (always delta, always full, auto: the kind"
        " measured faster) and compare mean sync times",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the fp32 master weights and AdamW live (cuda: the encode copies each part from GPU"
        " memory, cast to bf16 there first, as the trainer does; default cpu)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed syncs of each path per storage, after one untimed round, order alternating (default 3)",
    )
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.auto_versions == 1 or args.auto_versions < 0:
        ap.error("--auto-versions needs at least 2 versions (version 1 is always full)")
    if args.auto_versions and args.device != "cpu":
        ap.error("--auto-versions runs on the CPU only")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no GPU here")
    with contextlib.ExitStack() as mounts:
        storages = []
        for label in args.storage.split(","):
            if label == "sshfs":
                from shared_fs import sshfs_mount

                _, mnt = mounts.enter_context(sshfs_mount(Path(tempfile.mkdtemp(prefix="delta-bench-fs-"))))
                storages.append((label, mnt))
            else:
                path = STORAGE_ALIASES.get(label, Path(label)).expanduser()
                path.mkdir(parents=True, exist_ok=True)
                storages.append((label, path))
        Path(args.stage_root).expanduser().mkdir(parents=True, exist_ok=True)
        rows = []
        for gb in (float(x) for x in args.sizes.split(",")):
            for lr in (float(x) for x in args.lrs.split(",")):
                if args.auto_versions:
                    rows += run_auto(gb, lr, storages, Path(args.stage_root).expanduser(), args.auto_versions)
                else:
                    rows += run(
                        gb,
                        lr,
                        storages,
                        Path(args.stage_root).expanduser(),
                        args.warmup_steps,
                        args.device,
                        args.repeats,
                    )
                if args.json:  # after each size and lr: a killed run keeps what it measured
                    Path(args.json).write_text(json.dumps(rows, indent=2))
    (print_auto_table if args.auto_versions else print_table)(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
