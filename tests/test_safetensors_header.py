"""The one safetensors header reader (rollout_service/safetensors_header.py) against safetensors itself.

Every reader that needs where a file's tensors lie without handing the file to safetensors (the
finiteness scan, the delta rebuild, the adapter base check, the publisher's re-read of a model
folder) reads the header there. A header it accepts must be one safetensors opens with the same
tensors, and one safetensors refuses must be refused: each crafted header below is given to both.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rollout_service.checkpoint_format import CheckpointError
from rollout_service.safetensors_header import read_header


def write(path: Path, header: dict, data: bytes, *, raw: bytes | None = None) -> Path:
    blob = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def ours(path: Path, **kw: object) -> dict[str, tuple[str, tuple[int, ...], int, int]] | str:
    """What our reader finds: name -> (dtype, shape, start, end), or the refusal's reason."""
    fd = os.open(path, os.O_RDONLY)
    try:
        header = read_header(fd, os.fstat(fd).st_size, path.name, **kw)  # type: ignore[arg-type]
    except CheckpointError as exc:
        return exc.reason
    finally:
        os.close(fd)
    return {e.name: (e.dtype, e.shape, e.start, e.end) for e in header.entries}


def theirs(path: Path) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """What safetensors finds (name -> (dtype, shape)), or None when it refuses the file."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            return {k: (str(f.get_slice(k).get_dtype()), tuple(f.get_slice(k).get_shape())) for k in f.keys()}
    except Exception:
        return None


def test_a_file_safetensors_writes_is_read_with_its_offsets(tmp_path: Path) -> None:
    tensors = {
        "b": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "a": torch.ones(5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
        "ids": torch.arange(3, dtype=torch.int64),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    found = ours(path)
    assert isinstance(found, dict)
    assert {k: v[:2] for k, v in found.items()} == theirs(path)
    raw = path.read_bytes()
    for name, t in tensors.items():  # the offsets point at the tensor's own bytes
        _, _, start, end = found[name]
        assert raw[start:end] == t.contiguous().view(torch.uint8).numpy().tobytes(), name


def _entry(dtype: str, shape: list[int], start: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


CRAFTED = {
    "gap": ({"x": _entry("F32", [1], 0, 4), "y": _entry("F32", [1], 8, 12)}, 12),
    "overlap": ({"x": _entry("F32", [2], 0, 8), "y": _entry("F32", [2], 4, 12)}, 12),
    "padded_file": ({"x": _entry("F32", [1], 0, 4)}, 8),
    "short_file": ({"x": _entry("F32", [2], 0, 8)}, 4),
    "span_too_short": ({"x": _entry("F32", [3], 0, 8)}, 8),
    "span_too_long": ({"x": _entry("BF16", [2], 0, 8)}, 8),
    "reversed_offsets": ({"x": _entry("U8", [0], 4, 0)}, 4),
    "negative_dim": ({"x": _entry("U8", [-1], 0, 0)}, 0),
    "float_offset": ({"x": {"dtype": "U8", "shape": [4], "data_offsets": [0.0, 4]}}, 4),
    "no_shape": ({"x": {"dtype": "U8", "data_offsets": [0, 4]}}, 4),
    "unknown_dtype": ({"x": _entry("Q7", [4], 0, 4)}, 4),
    "not_an_object": ([1, 2], 0),
    "fine": ({"x": _entry("F32", [2], 0, 8), "y": _entry("U8", [3], 8, 11), "__metadata__": {"k": "v"}}, 11),
    "fine_empty": ({}, 0),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_header_gets_the_verdict_safetensors_gives(tmp_path: Path, case: str) -> None:
    header, data_len = CRAFTED[case]
    path = write(tmp_path / f"{case}.safetensors", header, bytes(range(256))[:data_len])
    found, expected = ours(path), theirs(path)
    if expected is None:
        assert found == "header_invalid", (case, found)
    else:
        assert isinstance(found, dict), (case, found)
        assert {k: v[:2] for k, v in found.items()} == expected
    assert (expected is None) == (case not in ("fine", "fine_empty"))  # the table means what it says


@pytest.mark.parametrize(
    ("case", "raw", "size_after"),
    [
        ("length_past_file", None, 0),
        ("not_json", b"{not json", 0),
        ("not_utf8", b'{"\xff": 1}', 0),
        ("too_few_bytes", b"", -1),
    ],
)
def test_a_broken_length_or_json_is_refused(tmp_path: Path, case: str, raw: bytes | None, size_after: int) -> None:
    path = tmp_path / f"{case}.safetensors"
    if case == "length_past_file":
        path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    elif case == "too_few_bytes":
        path.write_bytes(b"\x02\x00\x00")
    else:
        write(path, {}, b"", raw=raw)
    assert ours(path) == "header_invalid"
    assert theirs(path) is None


def test_a_header_over_the_callers_cap_is_refused_from_its_length(tmp_path: Path) -> None:
    header = {f"t{i}": _entry("U8", [1], i, i + 1) for i in range(200)}
    path = write(tmp_path / "big.safetensors", header, bytes(200))
    assert isinstance(ours(path), dict)
    assert ours(path, max_bytes=1000, reason="delta_corrupt") == "delta_corrupt"


def test_an_operators_file_may_hold_dtypes_no_checkpoint_holds(tmp_path: Path) -> None:
    """A model folder's file (``foreign``) may hold dtypes this project does not store; their
    sizes come from the offsets, and the tiling is still checked."""
    path = write(tmp_path / "m.safetensors", {"q": _entry("Q7", [4], 0, 2), "w": _entry("F32", [1], 2, 6)}, bytes(6))
    assert ours(path) == "header_invalid"
    found = ours(path, foreign=True)
    data_start = path.stat().st_size - 6
    assert isinstance(found, dict) and found["w"] == ("F32", (1,), data_start + 2, data_start + 6)
    gap = write(tmp_path / "g.safetensors", {"q": _entry("Q7", [4], 0, 2), "w": _entry("F32", [1], 3, 7)}, bytes(7))
    assert ours(gap, foreign=True) == "header_invalid"


def test_a_key_given_twice_is_refused_unless_the_file_is_the_operators(tmp_path: Path) -> None:
    first, last = json.dumps(_entry("U8", [9], 0, 9)), json.dumps(_entry("U8", [2], 0, 2))
    raw = f'{{"x": {first}, "x": {last}}}'.encode()
    path = write(tmp_path / "twice.safetensors", {}, bytes(2), raw=raw)
    assert ours(path) == "header_invalid"
    found = ours(path, foreign=True)  # as safetensors reads it: the last one counts
    assert isinstance(found, dict) and found["x"][:2] == ("U8", (2,))
    assert theirs(path) in ({"x": ("U8", (2,))}, None)


def test_a_file_cut_short_after_it_was_sized_is_an_error_not_a_crash(tmp_path: Path) -> None:
    """The size is the caller's (``fstat`` at open): a file cut shorter since is refused."""
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(64)}, str(path))
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        os.truncate(path, 8)
        with pytest.raises(CheckpointError) as info:
            read_header(fd, size, "m")
        assert info.value.reason == "header_invalid" and "cut short" in str(info.value)
    finally:
        os.close(fd)


def test_numpy_dtype_names_match_for_every_checkpoint_dtype(tmp_path: Path) -> None:
    """Each dtype a checkpoint holds reads back under its own tag with its element size."""
    for tag, array in {
        "F64": np.zeros(3, np.float64),
        "F16": np.zeros(3, np.float16),
        "I32": np.zeros(3, np.int32),
        "U8": np.zeros(3, np.uint8),
        "BOOL": np.zeros(3, np.bool_),
    }.items():
        path = write(tmp_path / f"{tag}.safetensors", {"t": _entry(tag, [3], 0, array.nbytes)}, array.tobytes())
        found = ours(path)
        assert isinstance(found, dict) and found["t"][:2] == (tag, (3,)), tag
        assert theirs(path) is not None, tag
