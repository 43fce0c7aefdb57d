"""What one junk step costs a reader is bounded by its manifest and the reference, not by its headers.

A shard's safetensors header may be 100 MB (``MAX_SHARD_HEADER_BYTES``): ~1.4M tiny entries,
which safetensors' parse and the specs made from it turn into ~1 GB. The reader used to parse
every shard of a step, keep all their specs, and only then compare the count with the manifest
and the names with the reference: a step of 7 such shards whose ``tensor_count`` was off by one
took 62 s and 3.6 GB before it was refused. Now a step whose shard entries do not add up to its
``tensor_count`` is refused before any header is read, and each header is counted
(``safetensors_header.count_entries``: one entry at a time) before safetensors parses it: it must
declare exactly what its manifest entry says and, with a reference, only the reference's names.
The tests count the parses (safetensors' ``safe_open``) and measure Python's peak allocation
(tracemalloc) on headers of a few hundred thousand entries; no wall times.
"""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import rollout_service.checkpoint_reader as cr
from rollout_service.checkpoint_format import CheckpointError, Manifest, step_dir_name
from rollout_service.checkpoint_reader import published_step_specs, validate_checkpoint
from rollout_service.checkpoint_writer import publish_checkpoint
from rollout_service.digest import file_digest
from rollout_service.safetensors_header import MAX_UNKNOWN_SHOWN, count_entries

BIG = 200_000
"""Entries of a crafted header (~15 MB of JSON): the specs made of them by the old reader took
~3.7 bytes of Python objects per byte of it (tracemalloc; safetensors' Rust side aside)."""


def shard_bytes(names: list[str], *, dtype: str = "F32", element: int = 4, metadata: bool = False) -> bytes:
    """A safetensors file of one-element tensors ``names`` (in this order, a name given twice
    taking the offsets of its first place: safetensors keeps one of them)."""
    entries, first = [], {}
    for name in names:
        at = first.setdefault(name, len(first)) * element
        spec = f'{{"dtype":"{dtype}","shape":[1],"data_offsets":[{at},{at + element}]}}'
        entries.append(f"{json.dumps(name, ensure_ascii=False)}:{spec}")
    if metadata:
        entries.insert(0, '"__metadata__":{"format":"pt"}')
    header = ("{" + ",".join(entries) + "}").encode("utf-8")
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + b"\0" * (element * len(first))


def crafted_step(
    root: Path,
    shards: dict[str, bytes],
    *,
    entries: dict[str, int] | None = None,
    tensor_count: int | None = None,
    index: dict[str, str] | None = None,
) -> Path:
    """A published step 1 whose weights are ``shards`` (file name -> bytes), listed in its
    manifest with their sizes and digests; each entry's ``tensors`` and ``tensor_count`` are
    ``entries``/``tensor_count`` when given (else what the headers hold, counted by safetensors).
    ``index``: the weight map written to the index (a sharded step needs one to be accepted)."""
    path = publish_checkpoint(root, 1, [("w", torch.zeros(1))], config={"model_type": "x"}, run_id="r").path
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "model.safetensors").unlink()
    del manifest["files"]["model.safetensors"]
    for fname, data in shards.items():
        (path / fname).write_bytes(data)
        if entries is not None and fname in entries:
            count = entries[fname]
        else:
            with safe_open(str(path / fname), framework="numpy") as f:
                count = len(f.keys())
        manifest["files"][fname] = {"size": len(data), "digest": file_digest(path / fname), "tensors": count}
    if index is not None:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
        p = path / "model.safetensors.index.json"
        manifest["files"][p.name] = {"size": p.stat().st_size, "digest": file_digest(p), "tensors": 0}
    listed = sum(e["tensors"] for f, e in manifest["files"].items() if f.endswith(".safetensors"))
    manifest["tensor_count"] = listed if tensor_count is None else tensor_count
    manifest["total_bytes"] = sum(e["size"] for e in manifest["files"].values())
    (path / "manifest.json").unlink()
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The size of each file safetensors was given to parse (the reader's private copies keep
    their file's size), in order."""
    seen: list[int] = []
    real = cr.safe_open

    def spy(path: str, *args: Any, **kw: Any) -> Any:
        seen.append(os.stat(path).st_size)
        return real(path, *args, **kw)

    monkeypatch.setattr(cr, "safe_open", spy)
    yield seen


def refusal(path: Path, **kw: Any) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        validate_checkpoint(path, **kw)
    return info.value


def peak_bytes_while(fn: Any) -> int:
    """Python's peak allocation while ``fn()`` runs (tracemalloc: safetensors' Rust side aside)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}.{i:07d}" for i in range(n)]


# --- the manifest's own counts: before any header ----------------------------------------------


def test_a_tensor_count_the_shard_entries_do_not_add_up_to_is_refused_before_any_header_is_read(
    tmp_path: Path, parses: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adversarial step, scaled down: every shard as its entry says, ``tensor_count`` one off.
    It used to be found after every shard was parsed and kept."""
    counted: list[str] = []
    real_count = getattr(cr, "count_entries", None)  # (absent before the count existed)

    def count_spy(raw: Any, where: str, **kw: Any) -> Any:
        counted.append(where)
        return real_count(raw, where, **kw)

    monkeypatch.setattr(cr, "count_entries", count_spy, raising=False)
    shards = {f"model-0000{i}-of-00003.safetensors": shard_bytes(names(f"s{i}", 2000)) for i in (1, 2, 3)}
    path = crafted_step(tmp_path, shards, tensor_count=6001)
    err = refusal(path)
    assert err.reason == "bad_manifest" and "hold 6000 tensors, tensor_count says 6001" in str(err), err
    assert parses == [] and counted == []
    with pytest.raises(CheckpointError) as info:  # the served step read as the reference: the same rule
        published_step_specs(path, root=tmp_path)
    assert info.value.reason == "bad_manifest" and parses == []


# --- each header counted before it is parsed ---------------------------------------------------


@pytest.mark.parametrize("declared", [BIG, 1], ids=["more", "fewer"])
def test_a_header_declaring_other_than_its_entry_says_is_refused_before_it_is_parsed(
    tmp_path: Path, parses: list[int], declared: int
) -> None:
    first = shard_bytes(names("junk", declared))
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": shard_bytes(["b"])}
    path = crafted_step(tmp_path, shards, entries={"model-00001-of-00002.safetensors": 2})
    peak = peak_bytes_while(lambda: pytest.raises(CheckpointError, validate_checkpoint, path).value)
    err = refusal(path)
    assert err.reason == "bad_manifest" and "model-00001-of-00002.safetensors holds" in str(err), err
    assert f"holds {'more than 2' if declared > 2 else declared} tensors, the manifest says 2" in str(err)
    assert parses == [], "a shard was parsed although its header declares other than its entry says"
    if declared == BIG:
        # the header is looked at once (as latin-1 text), never made into objects: ~1x its size;
        # the old reader's parse into specs took ~3.7x in Python alone
        assert peak < 1.5 * len(first), (peak, len(first))


def test_without_memfd_the_header_is_counted_too(
    tmp_path: Path, parses: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where ``memfd_create`` is missing, safetensors opens the file itself: the count comes first
    all the same."""
    monkeypatch.delattr(os, "memfd_create", raising=False)
    path = crafted_step(
        tmp_path, {"model.safetensors": shard_bytes(names("junk", BIG))}, entries={"model.safetensors": 3}
    )
    err = refusal(path)
    assert err.reason == "bad_manifest" and "holds more than 3 tensors, the manifest says 3" in str(err), err
    assert parses == []
    good = crafted_step(tmp_path / "good", {"model.safetensors": shard_bytes(["a", "b"])})
    assert validate_checkpoint(good).specs == {"a": ("F32", (1,)), "b": ("F32", (1,))}
    assert len(parses) == 1


def test_a_name_the_reference_lacks_is_refused_at_the_first_shard(tmp_path: Path, parses: list[int]) -> None:
    """With a reference, a shard of unknown names is refused before it (or any later shard) is
    parsed, though its entry and tensor_count agree with it."""
    reference = {n: ("F32", (1,)) for n in names("model", 4)}
    shards = {
        "model-00001-of-00002.safetensors": shard_bytes(names("junk", BIG)),
        "model-00002-of-00002.safetensors": shard_bytes(sorted(reference)),
    }
    index = dict.fromkeys(names("junk", BIG), "model-00001-of-00002.safetensors")
    index.update(dict.fromkeys(reference, "model-00002-of-00002.safetensors"))
    path = crafted_step(tmp_path, shards, entries={"model-00001-of-00002.safetensors": BIG}, index=index)
    peak = peak_bytes_while(lambda: pytest.raises(CheckpointError, validate_checkpoint, path, reference=reference))
    err = refusal(path, reference=reference, allow_float_cast=True)
    assert err.reason == "extra_tensor", err
    assert f"model-00001-of-00002.safetensors has {MAX_UNKNOWN_SHOWN} or more tensor(s) the reference lacks" in str(err)
    assert "'junk.0000000'" in str(err)
    assert parses == []
    assert peak < 1.5 * len(shards["model-00001-of-00002.safetensors"]), peak
    # no reference: the same step is only as large as its manifest says, and is read whole
    report = validate_checkpoint(path)
    assert len(report.specs) == BIG + 4 and len(parses) == 2


def test_one_unknown_name_is_named_with_its_shard(tmp_path: Path, parses: list[int]) -> None:
    reference = {"a": ("F32", (1,)), "b": ("F32", (1,))}
    shards = {
        "model-00001-of-00002.safetensors": shard_bytes(["a", "x"]),
        "model-00002-of-00002.safetensors": shard_bytes(["b"]),
    }
    index = {"a": "model-00001-of-00002.safetensors", "x": "model-00001-of-00002.safetensors"}
    path = crafted_step(tmp_path, shards, index={**index, "b": "model-00002-of-00002.safetensors"})
    err = refusal(path, reference=reference)
    assert err.reason == "extra_tensor", err
    assert "model-00001-of-00002.safetensors has 1 tensor(s) the reference lacks, e.g. 'x'" in str(err)
    assert parses == []


def test_a_header_may_not_declare_more_of_the_references_names_than_it_has(tmp_path: Path, parses: list[int]) -> None:
    """Only a name given again and again can make a header of known names longer than the
    reference: refused by the count (header_invalid), before safetensors parses it."""
    reference = {n: ("F32", (1,)) for n in names("model", 4)}
    cycled = [sorted(reference)[i % 4] for i in range(BIG)]
    path = crafted_step(tmp_path, {"model.safetensors": shard_bytes(cycled)}, entries={"model.safetensors": BIG})
    err = refusal(path, reference=reference)
    assert err.reason == "header_invalid" and "a name is given twice" in str(err), err
    assert parses == []


def test_a_name_given_twice_in_a_header_is_refused(tmp_path: Path) -> None:
    """safetensors keeps one of two entries of a name (here at the same offsets): the step used to
    pass with the manifest counting the names once. Its header holds one entry more."""
    data = shard_bytes(["a", "a", "b"])
    with safe_open_bytes(tmp_path, data) as f:
        assert sorted(f.keys()) == ["a", "b"]  # what safetensors (and SGLang) would load
    path = crafted_step(tmp_path / "root", {"model.safetensors": data}, entries={"model.safetensors": 2})
    err = refusal(path)
    assert err.reason == "bad_manifest" and "holds more than 2 tensors, the manifest says 2" in str(err), err


def safe_open_bytes(folder: Path, data: bytes) -> Any:
    path = folder / "probe.safetensors"
    path.write_bytes(data)
    return safe_open(str(path), framework="numpy")


def test_a_delta_file_declaring_other_blobs_is_refused_before_it_is_parsed(tmp_path: Path, parses: list[int]) -> None:
    from rollout_service.delta_writer import DeltaCheckpointWriter

    writer = DeltaCheckpointWriter(full_every=100)
    state = {f"layer.{i}": torch.randn(64, 64) for i in range(4)}
    writer.publish(tmp_path, 1, sorted(state.items()), config={"model_type": "x"}, run_id="r")
    for v in state.values():
        v.view(-1)[::50] += 0.5  # a few changes: a delta is smaller than a full step
    writer.publish(tmp_path, 2, sorted(state.items()), config={"model_type": "x"}, run_id="r")
    step = tmp_path / step_dir_name(2)
    assert Manifest.load(step).kind == "delta"
    validate_checkpoint(step)
    parses.clear()
    manifest = json.loads((step / "manifest.json").read_text())
    fname = sorted(f for f in manifest["files"] if f.endswith(".safetensors"))[0]
    data = shard_bytes(names("junk", BIG), dtype="U8", element=1)
    (step / fname).unlink()
    (step / fname).write_bytes(data)
    manifest["files"][fname].update(size=len(data), digest=file_digest(step / fname))
    manifest["total_bytes"] = sum(e["size"] for e in manifest["files"].values())
    (step / "manifest.json").unlink()
    (step / "manifest.json").write_text(json.dumps(manifest))
    err = refusal(step)
    assert err.reason == "delta_corrupt" and f"{fname} holds other tensors than the manifest assigns" in str(err)
    assert parses == []


# --- what is accepted stays accepted ---------------------------------------------------------


def test_sharded_steps_with_metadata_spacing_and_non_ascii_names_still_validate(
    tmp_path: Path, parses: list[int]
) -> None:
    tensors = {"modèle.poids": torch.ones(3), "层.0": torch.zeros(2, 2), "plain": torch.ones(1)}
    from safetensors.torch import save

    first = save({k: tensors[k] for k in ("modèle.poids", "plain")}, metadata={"format": "pt"})
    # the same header with JSON whitespace and \u escapes: still the same tensors to safetensors
    length = struct.unpack("<Q", first[:8])[0]
    header = json.loads(first[8 : 8 + length])
    spaced = json.dumps(header, indent=2, ensure_ascii=True).encode()
    spaced += b" " * (-len(spaced) % 8)
    first = struct.pack("<Q", len(spaced)) + spaced + first[8 + length :]
    second = save({"层.0": tensors["层.0"]})
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    index = {"modèle.poids": "model-00001-of-00002.safetensors", "plain": "model-00001-of-00002.safetensors"}
    index["层.0"] = "model-00002-of-00002.safetensors"
    path = crafted_step(tmp_path, shards, index=index)
    reference = {k: ("F32", tuple(v.shape)) for k, v in tensors.items()}
    report = validate_checkpoint(path, reference=reference, check_finite=True)
    assert report.specs == reference and len(parses) == 2
    assert validate_checkpoint(path).specs == reference
    assert published_step_specs(path, root=tmp_path) == reference
    fewer = dict(reference)
    del fewer["plain"]
    err = refusal(path, reference=fewer)
    assert err.reason == "extra_tensor" and "'plain'" in str(err), err


# --- count_entries itself ----------------------------------------------------------------------


def test_count_entries_agrees_with_safetensors_on_what_it_accepts(tmp_path: Path) -> None:
    cases = {
        "plain": shard_bytes(["a", "b", "c"]),
        "metadata": shard_bytes(["a", "b"], metadata=True),
        "non_ascii": shard_bytes(["é", "层", "a\u2028b"]),
        "escaped": shard_bytes(['q"uote', "back\\slash", "tab\tname"]),
        "empty": shard_bytes([]),
    }
    for case, data in cases.items():
        with safe_open_bytes(tmp_path, data) as f:
            theirs = sorted(f.keys())
        length = struct.unpack("<Q", data[:8])[0]
        found = count_entries(data[8 : 8 + length], case, limit=10, known=set(theirs))
        assert (found.count, found.unknown, found.complete) == (len(theirs), 0, True), case


def test_count_entries_stops_at_its_limit_and_at_the_third_unknown_name() -> None:
    raw = shard_bytes(names("t", 50))[8:]
    found = count_entries(raw, "x", limit=10)
    assert (found.count, found.complete) == (11, False)
    found = count_entries(raw, "x", limit=100, known={"t.0000001"})
    assert (found.count, found.unknown, found.complete) == (4, 3, False)
    assert found.examples == ("t.0000000", "t.0000002", "t.0000003")
    assert count_entries(raw, "x", limit=100).count == 50


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"[]",
        b'{"a":1,}',
        b'{"a" 1}',
        b'{"a":}',
        b'{"a":{"dtype":"F32"} "b":1}',
        b"{a:1}",
        b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"\xff":1}',
        b'{"a\x01":1}',
        b'{"a":1' + b"2" * 5000 + b"}",
    ],
    ids=repr,
)
def test_count_entries_refuses_what_is_not_a_json_object_of_entries(raw: bytes) -> None:
    with pytest.raises(CheckpointError) as info:
        count_entries(raw, "x", limit=10)
    assert info.value.reason == "header_invalid" and "x: its safetensors header" in str(info.value)
