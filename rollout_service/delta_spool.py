"""A delta's files written to storage while the version is still being encoded.

A delta's blobs are ready tensor by tensor, in file order, while the encode threads work
through the rest of the model. Written only once the whole version is encoded, they put the
storage's write on top of the encode: 0.05-0.18 s for the 20 MB of a 1 GB model's delta on the
test bed's network file system, and for a 7B model's ~400 MB on NFS-class storage most of a
second. :class:`DeltaSpool` instead hands each group of blobs (a shard's tensors, cut every
:data:`GROUP_BYTES`) to a writer thread as soon as it is complete, as its own
``delta-*.safetensors`` file in the hidden folder that becomes the step
(:func:`~rollout_service.checkpoint_writer.new_step_work_dir`): when the encode ends, only the
last group, the small files and the rename are left.

Nothing is visible to readers until the writer renames the folder into place
(:func:`~rollout_service.checkpoint_writer.atomic_step_dir`); a version that ends up full (too
large, a layout change, its base gone) or fails drops the folder (:meth:`DeltaSpool.abort`),
and a writer killed meanwhile leaves a hidden ``.tmp-*`` folder, removed by
:func:`~rollout_service.checkpoint_writer.cleanup_stale_temp_dirs`.
"""

from __future__ import annotations

import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from .checkpoint_format import FileEntry
from .checkpoint_writer import _write_shard, new_step_work_dir

GROUP_BYTES = 8 << 20
"""A delta file is cut once its blobs reach this size (8 MiB: a 1 GB model's ~20 MB delta is
written as 3-4 files, most of them while the encode runs; a 7B model's ~400 MB as ~50)."""


class DeltaSpool:
    """The delta files of ``step`` under ``root``, written on one thread as their blobs arrive.

    ``shards[i]`` lists the tensors of shard ``i`` (file order): a delta file holds tensors of
    one shard only, so that a rebuild reads each shard's files front to back. :meth:`add` takes
    the changed tensors' blobs in file order; :meth:`finish` waits for the files and returns
    them; :meth:`abort` removes everything. Used by one thread (the writer's)."""

    def __init__(self, root: Path, step: int, shards: list[list[str]], max_shard_bytes: int):
        self.root, self.step, self.max_shard_bytes = root, step, max_shard_bytes
        self._shard_of = {name: i for i, members in enumerate(shards) for name in members}
        self._shards = len(shards)
        self.work = new_step_work_dir(root, step)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="delta-spool")
        self._group: list[tuple[str, bytes]] = []
        self._group_shard = -1
        self._group_bytes = 0
        self._count: dict[int, int] = {}
        self._written: list[tuple[str, list[str], Future[FileEntry]]] = []

    def add(self, name: str, blob: bytes) -> None:
        """Take the blob of changed tensor ``name`` (tensors come in file order)."""
        shard = self._shard_of[name]
        if self._group and shard != self._group_shard:
            self._flush()
        self._group_shard = shard
        self._group.append((name, blob))
        self._group_bytes += len(blob)
        if self._group_bytes >= GROUP_BYTES:
            self._flush()

    def end(self) -> None:
        """No more blobs: hand the last group to the writer thread (without waiting)."""
        if self._group:
            self._flush()

    def _flush(self) -> None:
        shard = self._group_shard
        k = self._count[shard] = self._count.get(shard, 0) + 1
        fname = f"delta-{shard + 1:05d}-of-{self._shards:05d}-{k:03d}.safetensors"
        group = self._group
        self._group, self._group_bytes = [], 0
        job = self._pool.submit(
            _write_shard,
            self.work / fname,
            [(n, torch.frombuffer(bytearray(blob), dtype=torch.uint8)) for n, blob in group],
        )
        self._written.append((fname, [n for n, _ in group], job))

    def finish(self) -> tuple[dict[str, FileEntry], dict[str, str]]:
        """Wait for every file; return ``(file name -> entry, tensor -> its file)``. Raises what
        a write raised (the caller then calls :meth:`abort`)."""
        self.end()
        self._pool.shutdown(wait=True)
        files: dict[str, FileEntry] = {}
        file_of: dict[str, str] = {}
        for fname, names, job in self._written:
            files[fname] = job.result()
            for n in names:
                file_of[n] = fname
        return files, file_of

    def abort(self) -> None:
        """Stop taking blobs, wait for the writer thread, and remove the folder."""
        self._group = []
        for _, _, job in self._written:
            job.cancel()
        self._pool.shutdown(wait=True)
        shutil.rmtree(self.work, ignore_errors=True)
