"""Publishing the policy: FSDP1 gathered into full weights, the cast done before the copy to the
CPU, one snapshot copy in the checkpoint dtype, and private copies only where they are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from trainer_hooks import checkpoint_publisher
from trainer_hooks.checkpoint_publisher import CheckpointPublisher, cast_on_device
from trainer_hooks.weight_gather import iter_full_weights

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # subprocesses with torch start-ups: several seconds
@pytest.mark.parametrize(
    "peft, tied", [(False, False), (False, True), (True, False)], ids=["plain", "plain-tied", "peft-lora"]
)
def test_fsdp1_publishes_full_weights_not_flat_shards(tmp_path, peft, tied):
    """With PEFT (a review, session 30) the tuner layers were looked up by names that carry FSDP1's
    wrapper prefixes, under parameter names that do not: no layer was merged, and every version
    published the frozen base weights, the trained adapters left out (accepted by every sidecar).
    Without PEFT the units are unsharded one at a time (the whole model was, on every process),
    and the tensors come in the unsharded model's order, a tied head once."""
    out = tmp_path / "fsdp1.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(REPO / "tests" / "scripts" / "fsdp1_gather.py"),
            "--out",
            str(out),
            "--root",
            str(tmp_path / "ckpts"),
            *(["--peft"] if peft else []),
            *(["--tied"] if tied else []),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    main = json.loads(out.with_suffix(".rank0.json").read_text())
    other = json.loads(out.with_suffix(".rank1.json").read_text())
    assert main["is_fsdp1"] and (main["flat_local"] or peft), main  # FSDP1-sharded (use_orig_params: no flat names)
    assert main["names_match"], (main["missing"], main["extra"])
    assert main["shapes_match"] and main["values_match"], main
    assert main["files"] > 1
    # every parameter (LoRA's merged in; a tied head once), gathered collectively on the other rank too
    assert other["yielded"] == len(main["order"]) == (26 if tied else 27)
    for rank in (main, other):
        assert rank["in_model_order"], main["order"]
        assert rank["units"] >= 3, rank  # the root and each decoder layer
        if peft:  # merging draws a layer's base weights and its adapters at once: every unit
            assert rank["most_units_full"] == rank["units"], rank
        else:  # the root's own parameters and the one decoder layer being drawn
            assert rank["most_units_full"] == 2, rank


class _Recorder:
    """Stands in for publish_checkpoint: records the tensors it is handed (dtype, device)."""

    def __init__(self):
        self.seen = []

    def __call__(self, root, version, tensors, **kwargs):
        for name, t in tensors:
            self.seen.append((name, t.dtype, t.device.type))
        return SimpleNamespace(total_bytes=0, kind="full", full_bytes=0)


class _NoWait:
    def notify(self, version):
        pass

    def wait(self, version, timeout_s):
        pass

    def protected_versions(self):
        return set()


def _publisher(tmp_path, dtype):
    return CheckpointPublisher(
        tmp_path,
        _NoWait(),
        config={},
        dtype=dtype,
        max_shard_bytes=1 << 20,
        keep=None,
        sync_timeout_s=10,
        heartbeat_max_age_s=10,
    )


def test_floating_tensors_on_a_device_are_cast_there_before_the_copy_to_the_cpu():
    # The meta device stands in for a GPU: it has no data, so any copy to the CPU would fail.
    on_device = [
        ("w", torch.empty(4, 4, device="meta")),
        ("ids", torch.empty(4, dtype=torch.int64, device="meta")),
        ("h", torch.empty(2, device="meta", dtype=torch.bfloat16)),
    ]
    cast = list(cast_on_device(on_device, torch.bfloat16))
    assert [(n, t.dtype, t.device.type) for n, t in cast] == [
        ("w", torch.bfloat16, "meta"),
        ("ids", torch.int64, "meta"),
        ("h", torch.bfloat16, "meta"),
    ]
    cpu = torch.ones(3)
    [(_, same)] = cast_on_device([("c", cpu)], torch.bfloat16)
    assert same is cpu  # CPU tensors: the writer casts, as before (no extra copy)
    [(_, kept)] = cast_on_device([("k", on_device[0][1])], None)
    assert kept.dtype == torch.float32


def test_the_foreground_publish_casts_on_the_device_before_the_copy_to_the_host(tmp_path, monkeypatch):
    """The weights are drawn and copied to the host on the calling thread (the write runs on its
    own), each floating one on a device cast to the checkpoint dtype there first (half the bytes
    over PCIe for fp32 -> bf16). The meta device stands in for a GPU: its "copy" is recorded."""
    recorder = _Recorder()
    monkeypatch.setattr(checkpoint_publisher, "publish_checkpoint", recorder)
    copied: list[tuple[str, torch.dtype, str]] = []

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        copied.append((threading.current_thread().name, tensor.dtype, tensor.device.type))
        return tensor

    monkeypatch.setattr(checkpoint_publisher, "_to_host", to_host)
    publisher = _publisher(tmp_path, "bfloat16")
    publisher.publish_and_wait(1, [("a", torch.empty(8, device="meta")), ("b", torch.ones(2))])
    main = threading.main_thread().name
    assert copied == [(main, torch.bfloat16, "meta"), (main, torch.float32, "cpu")]
    assert recorder.seen == [("a", torch.bfloat16, "meta"), ("b", torch.float32, "cpu")]


def test_the_background_snapshot_is_one_copy_in_the_checkpoint_dtype(tmp_path):
    publisher = _publisher(tmp_path, "bfloat16")
    live = torch.nn.Linear(64, 64)
    ids = torch.arange(5)
    snapshot = publisher._snapshot(iter([("w", live.weight), ("ids", ids)]))
    (_, w), (_, i) = snapshot
    assert w.dtype == torch.bfloat16 and w.device.type == "cpu"  # not a float32 copy of the model
    assert torch.equal(w, live.weight.detach().to(torch.bfloat16))
    assert i.dtype == torch.int64 and i.data_ptr() != ids.data_ptr()  # a private copy
    with torch.no_grad():
        live.weight.add_(1.0)  # training goes on while the worker writes
    assert not torch.equal(w, live.weight.detach().to(torch.bfloat16))
    same_dtype = _publisher(tmp_path, None)._snapshot(iter([("w", live.weight)]))
    assert same_dtype[0][1].data_ptr() != live.weight.data_ptr()


def test_a_background_publish_writes_the_values_of_the_snapshot_time_in_the_checkpoint_dtype(tmp_path):
    publisher = _publisher(tmp_path, "bfloat16")
    live = torch.nn.Linear(16, 16)
    expected = live.weight.detach().to(torch.bfloat16).clone()
    publisher.publish_in_background(1, [("w", live.weight)])
    with torch.no_grad():
        live.weight.mul_(3.0)
    publisher.join()
    [path] = (tmp_path / "step-00000001").glob("*.safetensors")
    assert torch.equal(load_file(str(path))["w"], expected)


def test_zero3_gathered_parameters_are_copied_on_the_main_process_only():
    import deepspeed  # noqa: F401  (pinned in requirements/cpu.lock)

    model = torch.nn.Linear(4, 4)  # no ds_id: GatheredParameters is a no-op, the copy policy is what is tested
    plugin = SimpleNamespace(zero_stage=3)

    def run(is_main):
        acc = SimpleNamespace(
            state=SimpleNamespace(deepspeed_plugin=plugin), device=torch.device("cpu"), is_main_process=is_main
        )
        return dict(iter_full_weights(model, acc))

    main = run(True)
    other = run(False)
    assert main["weight"].data_ptr() != model.weight.data_ptr()  # written: a private copy
    assert other["weight"].data_ptr() == model.weight.data_ptr()  # only gathered: no copy
