"""Where the tensors of an untrusted safetensors file lie: its header, read and checked once.

A safetensors file is an 8-byte little-endian length, that many bytes of JSON (tensor name ->
dtype, shape and ``data_offsets`` relative to the end of the header; ``__metadata__`` aside),
then the tensors' bytes. Several readers need where each tensor lies without handing the file
to safetensors: the finiteness scan of ``validate``, the delta rebuild (a base shard and each
delta file), the adapter's base check (a model folder's first values) and the publisher's
re-read of a model folder. They all read the header here, by safetensors' own rules, so a
file one of them accepts is one SGLang's loader would open the same way:

- the length field fits the file and the caller's cap (a crafted length is refused before a
  buffer is sized by it); the JSON is a UTF-8 object;
- each entry has a dtype, a shape of at most :data:`MAX_DIMS` non-negative dimensions and two
  integer offsets that span dtype size x elements bytes;
- sorted by offset the entries tile the data section from its start to the end of the file, with
  no gap and no overlap.

Whether SGLang can *load* a file stays for safetensors itself to say
(:func:`~rollout_service.checkpoint_reader.read_safetensors_specs` asks it, on a private copy of
the header); this module never maps a file, so a file truncated meanwhile is an error, not a
``SIGBUS``. Before a checkpoint's header is handed to safetensors (or parsed here), the reader
counts its entries with :func:`count_entries`: one entry at a time, stopping past the number the
manifest or the reference allows, so a header of a million crafted entries is refused for the
few bytes of each it looked at, not for the gigabytes a parse of all of them takes.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from .checkpoint_format import DTYPE_SIZES, MAX_SHARD_HEADER_BYTES, CheckpointError, parse_json_object

MAX_DIMS = 8
"""Dimensions a tensor of a checkpoint may have (a model's weights have at most 5)."""
MAX_FOREIGN_DIMS = 64
"""Dimensions a tensor of an operator's model file may have (safetensors sets no limit; this one
only bounds the work a crafted header makes)."""
MAX_DIM = 1 << 40
"""The largest dimension taken (a tensor larger than any storage is a crafted header)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: where its bytes are (absolute offsets into the file)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    """A checked header: ``prefix`` (the length field and the JSON, as in the file), and the
    tensors in file order."""

    prefix: bytes
    entries: tuple[Entry, ...]

    @property
    def data_start(self) -> int:
        return len(self.prefix)

    def by_name(self) -> dict[str, Entry]:
        return {e.name: e for e in self.entries}


def header_length(head: bytes | memoryview, size: int, where: str, *, max_bytes: int, reason: str) -> int:
    """The JSON length a file of ``size`` bytes declares in its first 8 bytes ``head``; refused
    (``reason``) when it runs past the file or past ``max_bytes``."""
    if size < 8 or len(head) < 8:
        raise CheckpointError(reason, f"{where} has {size} bytes, too few for a safetensors file")
    (length,) = struct.unpack("<Q", bytes(head[:8]))
    if length > size - 8:
        raise CheckpointError(
            reason, f"{where}: its safetensors header says it has {length} bytes, the file has {size}"
        )
    if length > max_bytes:
        raise CheckpointError(
            reason,
            f"{where}: its safetensors header has {length} bytes, more than the {max_bytes} such a file may have",
        )
    return length


def parse_entries(
    raw: bytes | memoryview, size: int, where: str, *, reason: str, foreign: bool = False
) -> tuple[Entry, ...]:
    """The entries of header JSON ``raw`` of a file of ``size`` bytes, in file order, checked by
    the rules above (``reason`` on any breach). ``foreign``: a file the operator supplies (a
    model folder), which may hold dtypes no checkpoint of this project holds (their sizes are
    then taken from the offsets) and whose JSON is read as safetensors reads it (a key given
    twice: the last counts)."""
    data_start = 8 + len(raw)
    header = parse_json_object(
        bytes(raw), where=f"{where}'s safetensors header", reason=reason, unique_keys=not foreign
    )
    header.pop("__metadata__", None)
    entries = []
    for name, e in header.items():
        dtype = e.get("dtype") if isinstance(e, dict) else None
        shape = e.get("shape") if isinstance(e, dict) else None
        offsets = e.get("data_offsets") if isinstance(e, dict) else None
        if not (
            isinstance(dtype, str)
            and (dtype in DTYPE_SIZES or foreign)
            and isinstance(shape, list)
            and len(shape) <= (MAX_FOREIGN_DIMS if foreign else MAX_DIMS)
            and all(type(x) is int and 0 <= x < MAX_DIM for x in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(x) is int for x in offsets)
            and 0 <= offsets[0] <= offsets[1]
            and (dtype not in DTYPE_SIZES or offsets[1] - offsets[0] == DTYPE_SIZES[dtype] * math.prod(shape))
        ):
            raise CheckpointError(
                reason,
                f"{where}: the header entry for {str(name)[:80]!r} is not a known dtype, a shape and"
                " data_offsets that span its bytes",
            )
        entries.append(Entry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1]))
    entries.sort(key=lambda e: (e.start, e.end))
    at = data_start
    for e in entries:
        if e.start != at:
            gap = "overlaps the one before" if e.start < at else "leaves a gap before it"
            raise CheckpointError(reason, f"{where}: the header's tensor {e.name[:80]!r} {gap}")
        at = e.end
    if at != size:
        raise CheckpointError(
            reason, f"{where}: the header's tensors end at byte {at}, the file has {size} (truncated or padded)"
        )
    return tuple(entries)


_WHITESPACE = re.compile(r"[ \t\n\r]*")
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
"""``(value, end)`` of the JSON value at an index of a text (C code, strict: no control
characters in strings); raises ``StopIteration(index)`` where none starts."""
MAX_UNKNOWN_SHOWN = 3
"""Names outside those a file may hold that :func:`count_entries` collects before it stops."""


@dataclass(frozen=True)
class EntryCount:
    """What :func:`count_entries` found in a header: ``count`` tensors (``__metadata__`` aside),
    ``unknown`` of them not among the names it was given (``examples``: their names). ``complete``
    is False when it stopped early: past its limit (``count`` is then ``limit + 1``) or at the
    :data:`MAX_UNKNOWN_SHOWN`-th unknown name."""

    count: int
    unknown: int = 0
    examples: tuple[str, ...] = ()
    complete: bool = True


def count_entries(
    raw: bytes | bytearray | memoryview,
    where: str,
    *,
    limit: int,
    known: Collection[str] | None = None,
    reason: str = "header_invalid",
) -> EntryCount:
    """Count the tensors safetensors header JSON ``raw`` (the bytes after the length field)
    declares, without building them: each entry is read and dropped in turn, and the count stops
    at ``limit + 1``. So a header is measured against what it may hold (a manifest's count, a
    reference's names) for the memory of one entry, before anything parses all of it:
    safetensors' parse of a 100 MB header of 1.35M tiny entries takes ~10 s and ~0.5 GB, and the
    Python specs made from it as much again.

    ``known``: the names the file may hold; the others are counted in ``unknown`` and the count
    stops at the :data:`MAX_UNKNOWN_SHOWN`-th. More entries with known names than ``known``
    holds is a name given twice, refused (``reason``), as is JSON that is not an object of
    entries. What the entries say (dtypes, shapes, offsets) is not looked at: that is for the
    parse that follows, which then has at most ``limit`` entries to read (with ``known`` and no
    unknown name, at most ``len(known)``).

    The bytes are read as latin-1 (one character per byte, a copy the size of ``raw``): JSON's
    structure is ASCII and no byte of a multi-byte UTF-8 character is, so the structure read is
    the file's; a name with non-ASCII characters is decoded again from its own bytes as UTF-8.
    """
    text = str(raw, "latin-1")

    def bad(what: str) -> CheckpointError:
        return CheckpointError(reason, f"{where}: its safetensors header is not a JSON object of tensors ({what})")

    def skip_whitespace(i: int) -> int:
        return _WHITESPACE.match(text, i).end()  # type: ignore[union-attr]  # matches empty text too

    i = skip_whitespace(0)
    if text[i : i + 1] != "{":
        raise bad("it does not start with '{'")
    i = skip_whitespace(i + 1)
    if text[i : i + 1] == "}":
        return EntryCount(0)
    count = unknown = 0
    examples: list[str] = []
    try:
        while True:
            if text[i : i + 1] != '"':
                raise bad(f"a name was expected at byte {i}")
            start = i
            name, i = _scan(text, i)
            if not name.isascii():
                name = json.loads(text[start:i].encode("latin-1").decode("utf-8"))
            if text[i : i + 1] != ":":
                i = skip_whitespace(i)
                if text[i : i + 1] != ":":
                    raise bad(f"':' was expected at byte {i}")
            i += 1
            if text[i : i + 1] in " \t\n\r":
                i = skip_whitespace(i)
            _, i = _scan(text, i)
            if name != "__metadata__":
                count += 1
                if count > limit:
                    return EntryCount(count, unknown, tuple(examples), complete=False)
                if known is not None and name not in known:
                    unknown += 1
                    examples.append(name)
                    if unknown >= MAX_UNKNOWN_SHOWN:
                        return EntryCount(count, unknown, tuple(examples), complete=False)
                elif known is not None and count - unknown > len(known):
                    raise bad(f"it names more than the {len(known)} tensors it may hold: a name is given twice")
            if text[i : i + 1] not in (",", "}"):
                i = skip_whitespace(i)
            if text[i : i + 1] == "}":
                return EntryCount(count, unknown, tuple(examples))
            if text[i : i + 1] != ",":
                raise bad(f"',' or '}}' was expected at byte {i}")
            i += 1
            if text[i : i + 1] != '"':
                i = skip_whitespace(i)
    except CheckpointError:
        raise
    except StopIteration as exc:  # the scanner's word for "no JSON value here"
        raise bad(f"a value was expected at byte {exc.value}") from None
    except (ValueError, RecursionError) as exc:  # invalid JSON or UTF-8, a number too long
        raise bad(str(exc)[:200]) from None


def read_header(
    fd: int,
    size: int,
    where: str,
    *,
    max_bytes: int = MAX_SHARD_HEADER_BYTES,
    reason: str = "header_invalid",
    foreign: bool = False,
    check: Callable[[memoryview], None] | None = None,
) -> Header:
    """Read and check the header of the file behind ``fd`` (``size`` bytes, as ``fstat`` said
    when it was opened) with ``pread``: no file position is used or moved. ``check`` sees the
    header's JSON before it is parsed (e.g. :func:`count_entries` against the names it may hold)
    and raises ``CheckpointError`` to stop there."""
    length = header_length(_pread(fd, min(8, size), 0, where, reason), size, where, max_bytes=max_bytes, reason=reason)
    prefix = _pread(fd, 8 + length, 0, where, reason)
    if check is not None:
        check(memoryview(prefix)[8:])
    return Header(prefix, parse_entries(memoryview(prefix)[8:], size, where, reason=reason, foreign=foreign))


def _pread(fd: int, n: int, offset: int, where: str, reason: str) -> bytes:
    """Exactly ``n`` bytes at ``offset`` (a file cut shorter meanwhile: ``reason``)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = os.preadv(fd, [view[got:]], offset + got)
        if not k:
            raise CheckpointError(reason, f"{where} was cut short while its header was read")
        got += k
    return bytes(buf)
