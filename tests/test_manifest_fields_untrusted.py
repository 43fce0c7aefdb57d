"""Every field of a manifest is untrusted: any value of any JSON type, or none, is read or refused
as ``bad_manifest`` (``path_escape`` for a file name), a ``CheckpointError``, never a crash.

A manifest of each kind (full, delta, adapter with base values) is written by the project's own
writers; then each of its fields, at every depth, is replaced by values of every JSON type (and
removed), and the result is parsed. A ``TypeError`` from, say, a list where a dtype name was
expected (an unhashable value tested for membership in a set) would escape the sidecar's and the
CLI's handling of bad manifests: ``validate`` printed a traceback and the sidecar's step check
raised it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from delta_helpers import CONFIG, RUN, Model
from rollout_service.checkpoint_format import MANIFEST_NAME, CheckpointError, Manifest
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.delta_writer import DeltaCheckpointWriter

ODD_VALUES: list[Any] = [None, True, -1, 2**70, 1.5, "", "x" * 300, [], [1, "a"], {}, {"k": [1]}]
"""Values of every JSON type, each wrong somewhere."""


def paths(value: Any, at: tuple = ()) -> Iterator[tuple]:
    """Every place in a JSON value (dict keys and list indexes, at every depth)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield (*at, k)
            yield from paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:3]):  # the first few items of a list stand for the rest
            yield (*at, i)
            yield from paths(v, (*at, i))


def replaced(data: dict, where: tuple, new: Any, remove: bool = False) -> dict:
    out = copy.deepcopy(data)
    parent = out
    for key in where[:-1]:
        parent = parent[key]
    if remove and isinstance(parent, dict):
        del parent[where[-1]]
    else:
        parent[where[-1]] = new
    return out


def manifest_of(step_dir: Path) -> dict:
    return json.loads((step_dir / MANIFEST_NAME).read_text())


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("root")
    full = publish_checkpoint(root, 1, [("w", torch.zeros(4)), ("b", torch.ones(2))], config=CONFIG, run_id=RUN)
    model = Model(lr=1e-3)
    writer = DeltaCheckpointWriter(full_every=10)
    droot = tmp_path_factory.mktemp("delta-root")
    for step in (1, 2):
        model.step()
        writer.publish(
            droot, step, model.tensors(), config=CONFIG, dtype="bfloat16", max_shard_bytes=40_000, run_id=RUN
        )
    found = {"full": manifest_of(full.path), "delta": manifest_of(droot / "step-00000002")}
    assert found["delta"]["kind"] == "delta"
    from test_adapter_base_values import _publish_from

    found["adapter"] = manifest_of(_publish_from(tiny_model_dir, tmp_path_factory.mktemp("adapter-root"), 1))
    assert found["adapter"]["adapter"]["base_values"]
    return found


@pytest.mark.parametrize("kind", ["full", "delta", "adapter"])
def test_any_value_in_any_field_is_read_or_refused_as_bad_manifest(manifests: dict[str, dict], kind: str) -> None:
    data = manifests[kind]
    Manifest.from_json(json.dumps(data))  # the writers' own manifest reads
    crashes, tried = [], 0
    for where in paths(data):
        for new, remove in [(v, False) for v in ODD_VALUES] + [(None, True)]:
            tried += 1
            try:
                Manifest.from_json(json.dumps(replaced(data, where, new, remove)))
            except CheckpointError as exc:
                assert exc.reason in ("bad_manifest", "path_escape"), (where, new, exc)
            except Exception as exc:  # noqa: BLE001 - what this test looks for
                crashes.append(f"{'.'.join(map(str, where))} = {'(removed)' if remove else repr(new)[:40]}: {exc!r}")
    assert tried > 100
    assert not crashes, "\n".join(crashes[:20])
