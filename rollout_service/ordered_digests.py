"""Digests of a file and of each of its tensors, fed part by part from several threads.

A delta rebuild produces a file's parts on a thread pool, and each part's bytes are still in
its thread's own buffer (much of it in cache) right after the thread wrote them: hashing them
there spares a second pass over the written file, which costs 0.15-0.3 s per GB through a
mapping of tmpfs (``docs/benchmarks.md`` §4g), and it runs on every apply thread, not one.
xxh3 is a stream, so the parts must reach the hashers in file order:
:meth:`OrderedDigests.feed` waits until every earlier part was fed. Callers submit the parts to
a FIFO pool in file order, so an earlier part is always running or done and every wait ends;
a part that fails calls :meth:`OrderedDigests.abandon` so that the parts still waiting stop
(raising :class:`Abandoned`, which the caller ranks below the failure).

Where a part's bytes stay put after its thread moves on (the delta writer's held copy),
:meth:`OrderedDigests.offer` hands them over without waiting: whoever finds the next part
ready hashes the run of ready parts, so no thread idles while another hashes.
"""

from __future__ import annotations

import threading

from .digest import format_digest, new_hasher
from .untrusted_files import Deadline

WAIT_SLICE_S = 0.2
"""How often a waiting part checks its deadline."""


class Abandoned(Exception):
    """Another part failed: this part's bytes are not hashed (the rebuild is lost anyway)."""


class OrderedDigests:
    """The digest of a file (``prefix`` then every part) and of each tensor (its parts).

    ``part_tensors[i]`` is the index of the tensor that part ``i`` belongs to; parts are
    numbered in file order and a tensor's parts follow each other. A tensor without parts
    (no bytes) gets the digest of nothing.
    """

    def __init__(self, prefix: bytes | memoryview, part_tensors: list[int], tensor_count: int):
        self._file = new_hasher()
        self._file.update(prefix)
        self._tensors = [new_hasher() for _ in range(tensor_count)]
        self._part_tensors = part_tensors
        self._next = 0
        self._abandoned = False
        self._turn = threading.Condition()
        self._ready: dict[int, memoryview] = {}
        """Parts handed over by :meth:`offer` and not hashed yet."""
        self._hashing = threading.Lock()
        """Held by the caller of :meth:`offer` that is hashing the parts ready in order."""

    def feed(self, index: int, data: memoryview, deadline: Deadline, where: str) -> None:
        """Hash part ``index`` once parts ``0 .. index - 1`` are hashed (raises :class:`Abandoned`
        when a part failed, ``CheckpointError('validation_timeout')`` past the deadline)."""
        with self._turn:
            while self._next != index and not self._abandoned:
                self._turn.wait(WAIT_SLICE_S)
                deadline.check(where)
            if self._abandoned:
                raise Abandoned(where)
            self._file.update(data)
            self._tensors[self._part_tensors[index]].update(data)
            self._next += 1
            self._turn.notify_all()

    def offer(self, index: int, data: memoryview) -> None:
        """Hand over part ``index`` without waiting for its turn; its bytes must stay as they
        are until :meth:`result`. Whichever caller finds the next part in order ready hashes
        it and every ready part behind it, so no thread waits while another hashes (use either
        this or :meth:`feed` on one instance, not both)."""
        with self._turn:
            self._ready[index] = data
        while self._hashing.acquire(blocking=False):
            try:
                self._hash_ready()
            finally:
                self._hashing.release()
            with self._turn:  # a part offered while this caller held the lock: hash it too
                if self._next not in self._ready:
                    return

    def _hash_ready(self) -> None:
        """(Holding ``_hashing``.) Hash the offered parts that are next in order."""
        while True:
            with self._turn:
                data = self._ready.pop(self._next, None)
            if data is None:
                return
            self._file.update(data)
            self._tensors[self._part_tensors[self._next]].update(data)
            with self._turn:
                self._next += 1

    def abandon(self) -> None:
        """A part failed: wake every waiting part (each raises :class:`Abandoned`)."""
        with self._turn:
            self._abandoned = True
            self._turn.notify_all()

    def result(self) -> tuple[str, list[str]]:
        """The file's digest and each tensor's, once every part was fed or offered."""
        with self._hashing:  # parts another caller of offer() is still hashing
            self._hash_ready()
        if self._abandoned or self._next != len(self._part_tensors):
            raise RuntimeError(f"only {self._next} of {len(self._part_tensors)} parts were hashed")
        return format_digest(self._file), [format_digest(h) for h in self._tensors]
