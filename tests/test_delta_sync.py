"""Delta sync against a real SGLang server on the CPU: real TRL training published as deltas,
rebuilt in the sidecar's stage, served bit for bit; restarts, late joiners, corrupt links."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest
import torch

from delta_helpers import as_published, evolving_state, publish_chain
from helpers import generate
from rollout_service.checkpoint_format import Manifest, step_dir_name
from rollout_service.checkpoint_writer import iter_unique_tensors, publish_checkpoint
from rollout_service.delta_writer import DeltaCheckpointWriter
from sidecar_helpers import transformers_greedy, transformers_logprobs
from trainer_helpers import make_config, make_trainer
from trainer_hooks import checkpoint_publisher

PROMPT = [11, 42, 7, 99, 256, 3]
CONFIG_NAME = "config.json"


def _digests(manifest: Manifest) -> dict[str, str]:
    return {k: e.digest for k, e in manifest.files.items()}


def _staged_manifest(status: dict) -> Manifest:
    path = Path(status["last_sync"]["path"])
    return Manifest.load(path, root=path.parent)


def test_twenty_trained_versions_synced_as_deltas_serve_exactly_the_trainers_weights(
    sglang_server, sidecar_factory, checkpoint_root, tiny_model_dir, tmp_path, monkeypatch
):
    sidecar = sidecar_factory()
    full_root = tmp_path / "full"
    checks: list[tuple[int, str, bool]] = []
    original = checkpoint_publisher.CheckpointPublisher.publish

    def publish_and_compare(self, version, tensors, *, background):
        # An independent full publish of the very same weights, to compare the rebuild with.
        held = [(n, t.detach().clone()) for n, t in tensors]
        publish_checkpoint(
            full_root,
            version,
            held,
            config=self.config,
            dtype=self.dtype,
            max_shard_bytes=self.max_shard_bytes,
            run_id=self.run_id,
        )
        future = original(self, version, held, background=background)
        future.result()
        status = sidecar.status()
        assert status["loaded_step"] == version
        staged = _staged_manifest(status)
        full = Manifest.load(full_root / step_dir_name(version))
        checks.append((version, status["last_sync"]["kind"], _digests(staged) == _digests(full)))
        return future

    monkeypatch.setattr(checkpoint_publisher.CheckpointPublisher, "publish", publish_and_compare)
    config = make_config(
        tmp_path,
        checkpoint_root,
        [sglang_server.url],
        [sidecar.url],
        max_steps=21,
        learning_rate=1e-6,
        checkpoint_dtype="bfloat16",
        checkpoint_delta=True,
        checkpoint_full_every=8,
        keep_checkpoints=2,
    )
    trainer = make_trainer(tiny_model_dir, config)
    trainer.train()
    assert len(checks) >= 20, checks
    assert all(same for _, _, same in checks), [c for c in checks if not c[2]]
    kinds = [k for _, k, _ in checks]
    assert kinds[0] == "full" and kinds.count("delta") >= 17, kinds
    assert [v for v, k, _ in checks if k == "full"] == [
        checks[0][0] + 8 * i for i in range(len([k for k in kinds if k == "full"]))
    ]
    # The delta steps wrote a few percent of the full bytes (the metrics the trainer logs).
    logged_mb = [e["sglang/sync_mb"] for e in trainer.state.log_history if "sglang/sync_mb" in e]
    full_mb = [e["sglang/sync_full_mb"] for e in trainer.state.log_history if "sglang/sync_full_mb" in e]
    assert logged_mb and min(m / f for m, f in zip(logged_mb, full_mb)) < 0.5
    # Greedy output and logprobs of the served version equal transformers over the trainer's
    # weights as published (bf16, as SGLang got them).
    state = {
        n: t.detach().to(torch.bfloat16).to(torch.float32)
        for n, t in iter_unique_tensors(trainer.model.state_dict().items())
    }
    want = transformers_greedy(tiny_model_dir, state, PROMPT, 8)
    out = generate(sglang_server.url, PROMPT, max_new_tokens=8, ignore_eos=True, return_logprob=True)
    assert out["output_ids"] == want
    assert out["meta_info"]["weight_version"] == str(checks[-1][0])
    ours = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    theirs = transformers_logprobs(tiny_model_dir, state, PROMPT, want)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 2e-3, (ours, theirs)
    # /status and /metrics say what the last sync was.
    status = sidecar.status()
    assert status["last_sync"]["kind"] in ("full", "delta") and status["stage_bytes"] > 0
    # The stage kept the copy it stopped serving as its spare, and writes the next version over
    # it: safe only because SGLang keeps no mapping or descriptor of a staged file after a load.
    stage_dir = Path(status["last_sync"]["path"]).parent
    assert [p for p in stage_dir.iterdir() if p.name.startswith(".tmp-spare-")]
    assert not _files_held_by(sglang_server.pid, stage_dir)
    assert sidecar.metric("rollout_sidecar_last_sync_kind", kind=status["last_sync"]["kind"]) == 1
    assert sidecar.metric("rollout_sidecar_synced_bytes_total", kind="delta") > 0


def _files_held_by(pid: int | None, folder: Path) -> list[str]:
    """Files under ``folder`` that SGLang's processes (the server and its children) map or hold open."""
    import psutil

    assert pid is not None
    top = psutil.Process(pid)
    held = []
    for proc in [top, *top.children(recursive=True)]:
        paths = [m.path for m in proc.memory_maps(grouped=False)] + [f.path for f in proc.open_files()]
        held += [p for p in paths if p.startswith(str(folder.resolve()))]
    return held


def _wait_rejected(sidecar, step: int, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status = sidecar.status()
        if str(step) in status["rejected"] or time.monotonic() > deadline:
            return status
        time.sleep(0.3)


def test_restart_mid_chain_late_joiner_and_a_corrupt_delta(
    sglang_server, sidecar_factory, checkpoint_root, tiny_model_dir, tmp_path
):
    stage = ("--stage-dir", str(tmp_path / "stage-r0"))
    sidecar = sidecar_factory(*stage)
    writer, states = publish_chain(checkpoint_root, tiny_model_dir, range(1, 4))
    status = sidecar.wait_step(3)
    assert status["last_sync"]["kind"] == "delta"
    # Killed mid-chain; its successor adopts what SGLang serves and applies the next delta to it.
    sidecar.kill()
    sidecar2 = sidecar_factory(*stage, replica_id="r0")
    _, more = publish_chain(checkpoint_root, tiny_model_dir, range(4, 5), writer=writer)
    status = sidecar2.wait_step(4)
    assert status["last_sync"]["kind"] == "delta" and status["last_sync"]["chain_length"] == 1
    assert generate(sglang_server.url, PROMPT, max_new_tokens=8, ignore_eos=True)["output_ids"] == transformers_greedy(
        tiny_model_dir, as_published(more[4]), PROMPT, 8
    )
    # A late joiner with an empty stage replays the chain from the full step.
    sidecar2.stop()
    sidecar3 = sidecar_factory("--stage-dir", str(tmp_path / "fresh-stage"), replica_id="late")
    httpx.post(
        f"{sglang_server.url}/update_weights_from_disk",
        json={"model_path": str(tiny_model_dir), "weight_version": "default"},
        timeout=300,
    )
    status = sidecar3.wait_step(4)
    last = status["last_sync"]
    assert last["chain_length"] == 3  # full 1 -> deltas 2, 3, 4
    # /status and /metrics say what that sync did: the chain, the bytes it read from shared
    # storage (the full step and three deltas: more than one delta, at most the four steps), the
    # time it spent rebuilding in the stage, and what the stage holds.
    read_from_root = sum(Manifest.load(checkpoint_root / step_dir_name(s)).total_bytes for s in range(1, 5))
    assert last["kind"] == "delta" and 0 < last["apply_s"] <= last["validate_s"], last
    assert Manifest.load(checkpoint_root / step_dir_name(4)).total_bytes < last["bytes_read"] <= read_from_root, last
    assert sidecar3.metric("rollout_sidecar_last_sync_chain_length") == 3
    assert sidecar3.metric("rollout_sidecar_last_sync_bytes_read") == last["bytes_read"]
    assert sidecar3.metric("rollout_sidecar_last_sync_seconds", phase="apply") == pytest.approx(last["apply_s"])
    held = sidecar3.wait_stage_bytes()
    assert held > 0 and sidecar3.metric("rollout_sidecar_stage_bytes") > 0
    # A corrupt delta is rejected with a reason, the last good step keeps serving, and the next
    # full step recovers. (Flipping a byte of a published step races the sidecar: a corrupt copy
    # is made aside and renamed in.)
    publish_chain(checkpoint_root, tiny_model_dir, range(5, 6), writer=writer)
    side = tmp_path / "side"
    shutil.copytree(checkpoint_root / step_dir_name(5), side / step_dir_name(6))
    bad = sorted((side / step_dir_name(6)).glob("delta-*.safetensors"))[0]
    data = bytearray(bad.read_bytes())
    data[-5] ^= 0x10
    bad.write_bytes(bytes(data))
    m = Manifest.load(side / step_dir_name(6))
    status = sidecar3.wait_step(5)
    m.step, m.weight_version = 6, "6"
    (side / step_dir_name(6) / "manifest.json").write_text(m.to_json())
    (side / step_dir_name(6)).rename(checkpoint_root / step_dir_name(6))
    status = _wait_rejected(sidecar3, 6)
    assert status["rejected"].get("6") in ("digest_mismatch", "delta_corrupt"), status
    assert status["loaded_step"] == 5
    # The trainer restarts (nothing in memory, a new run id): its first publish is full, then
    # deltas again; the replica follows the new lineage.
    restarted, _ = publish_chain(checkpoint_root, tiny_model_dir, range(7, 8), run_id="r2")
    status = sidecar3.wait_step(7)
    assert status["last_sync"]["kind"] == "full" and status["loaded_run_id"] == "r2"
    publish_chain(checkpoint_root, tiny_model_dir, range(8, 9), writer=restarted, run_id="r2")
    status = sidecar3.wait_step(8)
    assert status["last_sync"]["kind"] == "delta" and status["last_sync"]["chain_length"] == 1
    # A truncated delta, then a delta whose base step is missing from the root: each rejected with
    # its reason while step 8 keeps serving. (Both made in a side root with the chain copied in,
    # then renamed into the checkpoint root.)
    side2 = tmp_path / "side2"
    for s in (7, 8):
        shutil.copytree(checkpoint_root / step_dir_name(s), side2 / step_dir_name(s))
    publish_chain(side2, tiny_model_dir, range(9, 11), writer=restarted, run_id="r2")
    assert [Manifest.load(side2 / step_dir_name(s)).kind for s in (9, 10)] == ["delta", "delta"]
    cut = sorted((side2 / step_dir_name(9)).glob("delta-*.safetensors"))[0]
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size // 2)
    (side2 / step_dir_name(9)).rename(checkpoint_root / step_dir_name(9))
    status = _wait_rejected(sidecar3, 9)
    assert status["rejected"].get("9") in ("truncated", "size_mismatch"), status["rejected"]
    (checkpoint_root / step_dir_name(9)).rename(tmp_path / "gone-9")  # the chain's link 9 is missing
    (side2 / step_dir_name(10)).rename(checkpoint_root / step_dir_name(10))
    status = _wait_rejected(sidecar3, 10)
    assert status["rejected"].get("10") == "broken_chain", status["rejected"]
    assert status["loaded_step"] == 8 and status["last_sync"]["step"] == 8
    out = generate(sglang_server.url, PROMPT, max_new_tokens=8, ignore_eos=True)
    assert out["meta_info"]["weight_version"] == "8"


def test_a_delta_without_a_stage_is_rejected_with_what_to_do(sidecar_factory, checkpoint_root, tiny_model_dir):
    sidecar = sidecar_factory("--no-stage")
    publish_chain(checkpoint_root, tiny_model_dir, range(1, 3))
    sidecar.wait_step(1)
    status = _wait_rejected(sidecar, 2)
    assert status["rejected"]["2"] == "delta_needs_stage"
    assert "--no-stage" in status["last_error"]["message"]


def test_nan_in_a_full_step_is_not_served_through_a_delta_on_it(
    sglang_server, sidecar_factory, checkpoint_root, tiny_model_dir, tmp_path
):
    """A late joiner replays a chain from its full step, copied in with its digests checked: a
    NaN in a tensor no delta changes is that copy's own, so the rebuilt copy is checked whole.
    (It used to be checked only where the deltas changed it: the full step was rejected on its
    own, then served through the delta on it.)"""
    config = json.loads((tiny_model_dir / CONFIG_NAME).read_text())
    writer = DeltaCheckpointWriter(check_finite=False)  # a writer that does not check
    first = evolving_state(tiny_model_dir, 1)
    names = sorted(first)
    first[names[0]].view(-1)[3] = float("nan")
    second = {k: v.clone() for k, v in first.items()}
    second[names[-1]].view(-1)[::7] += 0.25  # the delta changes another tensor only
    for step, state in ((1, first), (2, second)):
        writer.publish(checkpoint_root, step, sorted(state.items()), config=config, dtype="bfloat16", run_id="nan")
    assert Manifest.load(checkpoint_root / step_dir_name(2)).kind == "delta"
    httpx.post(  # SGLang back on its base model: the sidecar has nothing to adopt
        f"{sglang_server.url}/update_weights_from_disk",
        json={"model_path": str(tiny_model_dir), "weight_version": "default"},
        timeout=300,
    )
    sidecar = sidecar_factory("--stage-dir", str(tmp_path / "stage-nan"), replica_id="nan")
    _wait_rejected(sidecar, 2)
    status = _wait_rejected(sidecar, 1)
    assert status["rejected"].get("2") == "non_finite" and status["rejected"].get("1") == "non_finite", status
    assert status["loaded_step"] is None, status
