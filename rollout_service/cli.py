"""The ``rollout-service`` commands: publish, validate, materialize, sidecar, serve, make-tiny-model, liveness.

Run ``rollout-service <command> --help`` for each command's flags. Flags of the long-running
commands can also be set with ``ROLLOUT_*`` environment variables (``--help`` names each one).
This module is the parser, the dispatch and each command's body. The flags of settings are not
written here: they are derived from the dataclasses that declare them (``SidecarSettings``,
``serve``'s ``RestartPolicy`` and ``LoraServing``) by :mod:`rollout_service.cli_env`, which also
holds the env-backed flag machinery the other flags use.

The installed ``rollout-service`` console command is ``rollout_demo.cli``, which adds ``demo`` (it
trains with ``trainer_hooks``, which this package must not import); ``python -m
rollout_service.cli`` runs these commands without it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import itertools
import json
import logging
import os
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from .checkpoint_format import MAX_ADAPTER_RANK, MAX_STEP, CheckpointError, Manifest
from .cli_env import (
    SHARD_MB_RANGE,
    TIMEOUT_S,
    EnvArgumentParser,
    RedactingArgumentParser,
    SettingFlags,
    add_env_argument,
    given_as,
    not_blank,
    number_type,
    range_text,
)
from .http_urls import bindable_port, listening_sockets
from .lora_serving import DEFAULT_MAX_RANK, DEFAULT_TARGET_MODULES, add_lora_flags, lora_from_args, module_list
from .publish_dtypes import PUBLISHABLE_DTYPES, publishable_dtype_argument
from .serve import STOP_SIGNALS, RestartPolicy, run_serve
from .sglang_key import API_KEY_OPTIONS
from .sglang_launcher import SGLangServer, SGLangServerConfig, flag_value, free_port, server_url
from .shown_values import ShownLogFormatter, escape_controls
from .sidecar.root_gate import answered_within
from .sidecar.settings import SidecarSettings
from .user_paths import new_folder_path, setting_path

if TYPE_CHECKING:  # checkpoint_reader imports safetensors: only the commands that read checkpoints do
    from .checkpoint_reader import TensorSpecs

SIDECAR_SETTINGS = SettingFlags(SidecarSettings)
"""`sidecar`'s flags: one per SidecarSettings setting."""
SERVE_SIDECAR_SETTINGS = SettingFlags(SidecarSettings, exclude={"sglang_url"}, flags={"port": "--sidecar-port"})
"""`serve`'s sidecar flags: the URL is the SGLang server it starts, and `--port` is SGLang's."""
SERVE_RESTART_SETTINGS = SettingFlags(RestartPolicy)
"""`serve`'s restart budget and startup timeout."""
SERVE_SGLANG_SETTINGS = SettingFlags(SGLangServerConfig, defaults={"port": 30000})
"""`serve`'s SGLang flags (`--model`, `--port`, ...): SGLang's usual port, where the library picks a free one."""

SECONDS = number_type(float, *TIMEOUT_S)
"""The type of the one-shot commands' ``--timeout`` flags: finite, positive, at most a week."""
SHARD_MB = number_type(float, *SHARD_MB_RANGE)
"""The type of ``publish --max-shard-mb``: from about 1 KiB to 1 TiB."""
SEED_RANGE = (0, 2**32 - 1)
"""The seeds ``make-tiny-model --seed`` takes (numpy's)."""
SEED = number_type(int, *SEED_RANGE)
"""The type of ``make-tiny-model --seed``."""
LORA_RANK = number_type(int, 1, MAX_ADAPTER_RANK)
"""The type of ``validate --max-lora-rank``."""
STEP = number_type(int, 0, MAX_STEP)
"""The type of ``publish --step`` and ``materialize --step``."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
"""The ``--log-level`` names (any case; Python's aliases WARN and FATAL too)."""


def log_level(name: str) -> str:
    """The type of ``--log-level``: ``name`` as one of :data:`LOG_LEVELS`, else an
    ``ArgumentTypeError`` listing them (also for ``ROLLOUT_LOG_LEVEL``, which argparse's
    ``choices`` would not check)."""
    level = {"WARN": "WARNING", "FATAL": "CRITICAL"}.get(name.upper(), name.upper())
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid choice: {level!r} (choose from {', '.join(LOG_LEVELS)})")
    return level


def _cmd_publish(args: argparse.Namespace) -> int:
    from .checkpoint_format import step_dir_name
    from .model_dir_source import publish_model_dir

    _check_publish_paths(Path(args.model_dir), Path(args.checkpoint_path))
    step_dir = Path(args.checkpoint_path) / step_dir_name(args.step)
    started = time.time()
    try:
        result = publish_model_dir(
            args.model_dir,
            args.checkpoint_path,
            args.step,
            dtype=args.dtype,
            max_shard_bytes=int(args.max_shard_mb * (1 << 20)),
        )
    except OSError as exc:
        raise _publish_error(exc, Path(args.checkpoint_path), Path(args.model_dir)) from None
    except KeyboardInterrupt:
        manifest = _published_here(step_dir, since=started)
        if manifest is None:
            raise  # nothing became visible: the work folder was removed on the way out
        # The signal landed after the rename (syncing the root, the last log line): the step
        # is published, and saying otherwise would have a retry refused as "already published".
        signum = _interrupted_by.pop() if _interrupted_by else signal.SIGINT
        print(
            f"interrupted by {signal.Signals(signum).name} after {step_dir} was published: it stays published",
            file=sys.stderr,
        )
        _print_published(
            step_dir,
            manifest.step,
            manifest.weight_version,
            manifest.total_bytes,
            manifest.tensor_count,
            len(manifest.files),
        )
        return 0
    _print_published(
        result.path,
        result.step,
        result.weight_version,
        result.total_bytes,
        result.tensor_count,
        result.files,
        seconds=round(result.total_seconds, 3),
    )
    return 0


def _check_publish_paths(model_dir: Path, root: Path) -> None:
    """Refuse (ValueError, before anything is written) a ``--checkpoint-path`` that is
    ``--model-dir`` or inside it (the step would be written into the model it reads), or that is
    inside a published step or a materialized model (a folder holding a manifest: readers would
    see a step inside a step, and a retention pass of the outer root could remove it)."""
    from .checkpoint_format import MANIFEST_NAME
    from .checkpoint_paths import is_inside

    if is_inside(root, model_dir):
        raise ValueError(
            f"--checkpoint-path {root} is --model-dir {model_dir} or inside it: publish into a checkpoint"
            " root outside the model directory"
        )
    real = Path(os.path.realpath(root))
    for folder in (real, *real.parents):
        if os.path.isfile(folder / MANIFEST_NAME):
            where = "is" if folder == real else "is inside"
            raise ValueError(
                f"--checkpoint-path {root} {where} {folder}, which holds a {MANIFEST_NAME} (a published step"
                " or a materialized model): give the checkpoint root itself, the folder that holds the step-*"
                " directories"
            )


def _publish_error(exc: OSError, root: Path, model_dir: Path) -> OSError:
    """``exc`` from ``publish`` as an error naming the flag of the path it is about: the root
    (``--checkpoint-path``: it, a folder above it or a file written in it, or a write error that
    names no file), else ``--model-dir`` (a file read there); ``exc`` itself when neither."""
    if _about_path(exc, root, area=root):
        hint = _write_hint(exc, root, "--checkpoint-path", "that is a directory or can be made one")
        return OSError(f"cannot write --checkpoint-path {root}: {exc.strerror or exc} ({hint})")
    if exc.filename is not None and _within(os.path.abspath(os.fsdecode(exc.filename)), model_dir):
        return OSError(f"cannot read --model-dir {model_dir}: {_os_error_text(exc)}")
    return exc


def _about_path(exc: OSError, path: Path, *, area: Path) -> bool:
    """Whether ``exc`` is about writing ``path``: it names ``path``, a folder above it, or a file
    in ``area`` (where the command writes: its work folders), or it names no file and is an
    error only writing gives."""
    if exc.filename is None:
        return exc.errno in _WRITE_ERRNOS
    name = os.path.abspath(os.fsdecode(exc.filename))
    return _within(name, area) or _within(os.path.abspath(path), Path(name))


def _path(text: str) -> str:
    return text


path_text = not_blank(_path, "give a path (an empty one would mean the current directory)")
"""The type of the commands' path arguments: the text itself, refusing an empty or blank one
(``Path("")`` is the current directory: ``--checkpoint-path ""`` would publish into it and
``--reference ""`` would compare nothing)."""


def _os_error_text(exc: OSError) -> str:
    """``Permission denied: /x/y`` for ``[Errno 13] Permission denied: '/x/y'``: the reason and the
    file, without the errno number (the message itself for an error that has no errno)."""
    if not exc.strerror:
        return str(exc)
    if exc.filename is None:
        return exc.strerror
    names = os.fsdecode(exc.filename) + ("" if exc.filename2 is None else f" -> {os.fsdecode(exc.filename2)}")
    return f"{exc.strerror}: {names}"


def _print_published(
    path: Path, step: int, weight_version: str, total_bytes: int, tensors: int, files: int, **extra: Any
) -> None:
    """``publish``'s one line of JSON on stdout: what became visible."""
    fields = {"published": str(path), "step": step, "weight_version": weight_version, "bytes": total_bytes}
    print(json.dumps({**fields, "tensors": tensors, "files": files, **extra}))


def _published_here(step_dir: Path, *, since: float) -> Manifest | None:
    """``step_dir``'s manifest when this process wrote it after ``since`` (publish refuses a step
    that exists, so such a step is the one this run renamed into place)."""
    from .checkpoint_writer import writer_identity

    try:
        manifest = Manifest.load(step_dir.absolute(), root=step_dir.absolute().parent)
    except Exception:  # not there (the interrupt came first), or not ours to vouch for
        return None
    writer = manifest.writer or {}
    mine = writer_identity()
    ours = (writer.get("host"), writer.get("pid")) == (mine["host"], mine["pid"]) and manifest.created_at >= since
    return manifest if ours else None


def _cmd_validate(args: argparse.Namespace) -> int:
    try:
        reference = _reference_specs(Path(args.reference)) if args.reference is not None else None
    except (OSError, CheckpointError) as exc:
        why = f" ({exc.reason}): {exc}" if isinstance(exc, CheckpointError) else f": {_os_error_text(exc)}"
        print(escape_controls(f"error: cannot read --reference {args.reference}{why}"), file=sys.stderr)
        return 2
    try:
        summary = _validate_step(args, reference)
    except CheckpointError as exc:  # every bad input arrives as one (see checkpoint_reader, adapter_reader)
        usage = None if args.root is None else _folder_problem(Path(args.root), "--root")
        if usage is not None:  # not the step's fault: a usage error
            print(escape_controls(f"error: {usage}"), file=sys.stderr)
            return 2
        hint = _root_given_hint(Path(args.dir)) if exc.reason == "missing_manifest" else None
        print(escape_controls(f"INVALID ({exc.reason}): {exc}{hint or ''}"), file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


LOOK_BOUND_S = 10.0
"""How long the commands' look at a folder a user named may take when explaining an error (a
hung network file system would otherwise hang the explanation)."""


def _folder_problem(folder: Path, flag: str) -> str | None:
    """What is wrong with ``folder`` (the folder ``flag`` names) when it does not exist, is not a
    directory, or does not answer within :data:`LOOK_BOUND_S`; None when it is a directory."""

    def look() -> str | None:
        try:
            st = os.stat(folder)
        except FileNotFoundError:
            return f"{flag} {folder} does not exist: name an existing directory"
        except OSError as exc:
            return f"{flag} {folder} cannot be looked at: {_os_error_text(exc)}"
        return None if stat.S_ISDIR(st.st_mode) else f"{flag} {folder} is not a directory: name a directory"

    answered, problem = answered_within(look, LOOK_BOUND_S, f"looking at {flag}")
    return problem if answered else f"{flag} {folder} did not answer within {LOOK_BOUND_S:g} s (a hung mount?)"


def _root_given_hint(folder: Path) -> str | None:
    """When ``folder`` (given as a step) holds ``step-*`` folders instead of a manifest: it is a
    checkpoint root, and the hint names one of its steps; else None (the look is bounded)."""
    from .checkpoint_format import parse_step_dir_name

    def look() -> str | None:
        with os.scandir(folder) as entries:
            for entry in itertools.islice(entries, 10_000):  # a root of a million entries is not listed whole
                if parse_step_dir_name(entry.name) is not None:
                    return entry.name
        return None

    try:
        answered, step = answered_within(look, LOOK_BOUND_S, "looking for steps")
    except OSError:
        return None
    if not answered or step is None:
        return None
    return f"; {folder} looks like a checkpoint root: validate one of its steps, e.g. {folder / step}"


def _reference_specs(path: Path) -> TensorSpecs:
    """The tensors ``--reference`` declares: a model directory's shards, or a published step's
    by its manifest (a full step's listed shards; the model a delta step rebuilds, from its
    manifest; an adapter step is no model). Raises ``CheckpointError``."""
    from .checkpoint_format import MANIFEST_NAME, Manifest
    from .checkpoint_reader import published_step_specs, read_model_specs

    path = path.absolute()
    if not path.is_dir():
        what = "is not a directory" if os.path.lexists(path) else "does not exist"
        raise NotADirectoryError(f"{path} {what}: give a model folder or a published step's folder")
    if not (path / MANIFEST_NAME).exists():
        return read_model_specs(path)
    manifest = Manifest.load(path, root=path.parent)
    if manifest.delta is not None:
        return {name: (t.dtype, tuple(t.shape)) for name, t in manifest.delta.tensors.items()}
    if manifest.kind == "adapter":
        raise CheckpointError(
            "adapter_step", f"{path} is a LoRA adapter step, not a model: give its base model as --reference"
        )
    return published_step_specs(path, root=path.parent)


def _validate_step(args: argparse.Namespace, reference: TensorSpecs | None) -> dict[str, Any]:
    """Validate ``args.dir`` by the rules of its manifest's kind; what passed, as printed.

    Full and delta steps are checkpoint_reader's (a delta's files), and a delta's chain and, with
    ``--digests``/``--check-finite``, the model it rebuilds (:func:`_check_delta_chain`);
    an adapter step is adapter_reader's, against ``--reference`` (else its own tensor shapes)
    and the LoRA limits of ``--max-lora-rank``/``--lora-target-modules``, as the sidecar checks
    it against the served model and ``/server_info``. Raises ``CheckpointError``."""
    from .checkpoint_reader import validate_checkpoint

    if _manifest_kind(args.dir, args.root) == "adapter":
        return _validate_adapter_step(args, reference)
    report = validate_checkpoint(
        args.dir,
        root=args.root,
        reference=reference,
        allow_float_cast=not args.exact_dtypes,
        check_digests=args.digests,
        check_finite=args.check_finite,
        timeout_s=args.timeout,
    )
    if report.manifest.kind == "delta":
        report.checks.extend(_check_delta_chain(args, report.manifest))
    return {
        "valid": str(report.path),
        "step": report.manifest.step,
        "kind": report.manifest.kind,
        "run_id": report.manifest.run_id,
        "tensors": len(report.specs),
        "bytes": report.manifest.total_bytes,
        "checks": report.checks,
    }


def _check_delta_chain(args: argparse.Namespace, manifest: Manifest) -> list[str]:
    """What a replica needs of the delta step ``manifest`` (validated) beyond its own files: its chain, published and
    consistent back to its full step; with ``--digests`` or ``--check-finite``, the model it
    rebuilds (rebuilt in a temporary folder, every byte checked against the digests of a full
    publish, NaN/Inf refused with ``--check-finite``). The checks that passed; raises
    ``CheckpointError``."""
    import contextlib
    import tempfile
    import uuid

    from .checkpoint_format import TEMP_PREFIX
    from .delta_apply import ChainLink, materialize, resolve_chain
    from .tree_removal import remove_tree
    from .untrusted_files import Deadline
    from .work_folders import owner_tag, remove_left_by_dead_writers

    step = manifest.step
    path = Path(args.dir).absolute()
    root = Path(args.root).absolute() if args.root is not None else path.parent
    chain = resolve_chain(root, ChainLink(path, manifest), None, Deadline(args.timeout))
    checks = [f"its delta chain back to full step {chain.start.manifest.step} is published and consistent"]
    if args.digests or args.check_finite:
        from .checkpoint_format import step_dir_name

        if path != root / step_dir_name(step):  # materialize rebuilds the step of that name
            raise ValueError(
                f"{path} holds delta step {step} under another name: --digests and --check-finite rebuild a"
                f" delta step from its root, so give {root / step_dir_name(step)} (or validate without them)"
            )
        # Named after this process, so that the next validate removes what a killed one left.
        scratch = Path(tempfile.gettempdir())
        for prefix in (VALIDATE_REBUILD_PREFIX, f"{TEMP_PREFIX}materialize-{VALIDATE_REBUILD_PREFIX}"):
            remove_left_by_dead_writers(scratch, prefix, "a validate --digests")
        out = scratch / f"{VALIDATE_REBUILD_PREFIX}{owner_tag()}-{uuid.uuid4().hex[:12]}"
        try:
            materialize(root, step, out, timeout_s=args.timeout, check_finite=args.check_finite)
        except CheckpointError:
            raise
        except ValueError as exc:  # no room: say where the rebuild goes
            raise ValueError(f"{exc} (validate rebuilds a delta step under $TMPDIR: point it elsewhere)") from None
        except OSError as exc:  # a full or failing $TMPDIR mid-way: say where, not only the errno
            if not _writing_failed(exc, scratch, root):
                raise
            raise OSError(
                exc.errno,
                f"rebuilding the step under {scratch} failed: {exc.strerror or exc} (validate rebuilds a delta"
                " step under $TMPDIR: free room there or point TMPDIR elsewhere)",
            ) from None
        finally:
            with contextlib.suppress(OSError):  # what is left, the next validate removes
                remove_tree(out)
        checks.append("the model it rebuilds matches the digests of a full publish, byte for byte")
        if args.check_finite:
            checks.append("every floating weight of the rebuilt model is finite")
    return checks


VALIDATE_REBUILD_PREFIX = "rollout-validate-"
"""The model ``validate --digests`` rebuilds from a delta step: ``$TMPDIR/<this>-<owner tag>-<hex>``."""


def _manifest_kind(step_dir: str, root: str | None) -> str | None:
    """The kind ``step_dir``'s manifest says; None when it cannot be read (the full validator
    then rejects the step with its own reason, in its own order)."""
    from .checkpoint_format import Manifest

    path = Path(step_dir).absolute()
    try:
        return Manifest.load(path, root=Path(root).absolute() if root is not None else path.parent).kind
    except Exception:  # untrusted input: validation names what is wrong
        return None


def _validate_adapter_step(args: argparse.Namespace, reference: TensorSpecs | None) -> dict[str, Any]:
    from .adapter_reader import LoraLimits, validate_adapter_step

    limits = LoraLimits(enabled=True, max_rank=args.max_lora_rank, target_modules=frozenset(args.lora_target_modules))
    report = validate_adapter_step(
        args.dir,
        root=args.root,
        reference=reference,
        limits=limits,
        check_digests=args.digests,
        check_finite=args.check_finite,
        timeout_s=args.timeout,
    )
    info = report.manifest.adapter
    assert info is not None  # validate_adapter refuses an adapter step without it
    reference_kind = _manifest_kind(args.reference, None) if args.reference is not None else "none"
    if info.base_values and reference_kind in (None, "full"):
        from .base_values import check_base_values  # a model folder, or a full step: its shards

        where, files = Path(args.reference), None
        if reference_kind == "full":  # a published step: the shards its manifest lists, nothing else in it
            files = list(Manifest.load(where.absolute(), root=where.absolute().parent).files)
        try:
            report.checks.append(check_base_values(info.base_values, where, where=Path(args.dir).name, files=files))
        except CheckpointError as exc:
            if exc.reason == "adapter_base_mismatch":
                raise
            raise ValueError(f"cannot read --reference {args.reference} for the adapter's base check: {exc}") from None
    return {
        "valid": str(report.path),
        "step": report.manifest.step,
        "kind": report.manifest.kind,
        "run_id": report.manifest.run_id,
        "tensors": report.manifest.tensor_count,
        "bytes": report.manifest.total_bytes,
        "checks": report.checks,
        "rank": info.rank,
        "modules": report.modules,
    }


def _cmd_materialize(args: argparse.Namespace) -> int:
    from .checkpoint_format import step_dir_name
    from .delta_apply import materialize, materialize_target

    out = materialize_target(args.out)
    existed = os.path.lexists(out)
    try:
        manifest = materialize(
            args.root,
            args.step,
            out,
            timeout_s=args.timeout,
            progress=lambda line: print(escape_controls(line), file=sys.stderr, flush=True),
        )
    except KeyboardInterrupt:
        done = None if existed else _materialized_at(out, args.root, args.step)
        if done is None:
            raise  # nothing under --out: the work folder was removed on the way out
        # The signal landed after the rename: the model is complete (materialize renames only
        # a validated copy), and saying otherwise would have a retry refused as "exists".
        signum = _interrupted_by.pop() if _interrupted_by else signal.SIGINT
        print(f"interrupted by {signal.Signals(signum).name} after {out} was complete: it stays", file=sys.stderr)
        manifest = done
    except CheckpointError as exc:
        usage = _materialize_root_problem(Path(args.root)) if exc.reason in ("missing_manifest", "unreadable") else None
        if usage is not None:  # not the step's fault: a usage error
            print(escape_controls(f"error: {usage}"), file=sys.stderr)
            return 2
        print(
            escape_controls(
                f"error: cannot materialize {step_dir_name(args.step)} under {args.root} ({exc.reason}): {exc}"
            ),
            file=sys.stderr,
        )
        return 1
    except OSError as exc:
        if isinstance(exc, FileExistsError) or not _writing_failed(exc, out.parent, Path(args.root)):
            raise  # about the root, or --out itself: the error names it
        raise OSError(
            exc.errno,
            f"writing the model next to {out} failed: {exc.strerror or exc} ({_write_hint(exc, out.parent)})",
        ) from None
    print(
        json.dumps(
            {
                "materialized": str(args.out),
                "step": manifest.step,
                "bytes": manifest.total_bytes,
                "files": sorted(manifest.files),
            }
        )
    )
    return 0


def _materialize_root_problem(root: Path) -> str | None:
    """What is wrong with ``materialize``'s ROOT itself, when it is not a directory or is a
    published step (it holds a manifest): the root is its parent; else None."""
    from .checkpoint_format import MANIFEST_NAME

    problem = _folder_problem(root, "ROOT")
    if problem is not None:
        return f"{problem} (the checkpoint root: the trainer's checkpoint_path)"
    answered, is_step = answered_within(lambda: os.path.lexists(root / MANIFEST_NAME), LOOK_BOUND_S, "looking at ROOT")
    if answered and is_step:
        return f"ROOT {root} is a published step, not the checkpoint root: give its parent, {root.absolute().parent}"
    return None


def _materialized_at(out: Path, root: Path, step: int) -> Manifest | None:
    """The manifest ``out`` holds when it is a model materialized from step ``step`` of ``root``
    as published now (its manifest names that publication as its source), else None."""
    from .checkpoint_format import step_dir_name

    try:
        manifest = Manifest.load(out, root=out.parent)
        root = Path(root).absolute()
        published = Manifest.load(root / step_dir_name(step), root=root)
    except Exception:  # not there (the interrupt came first), or no model
        return None
    return manifest if manifest.source_fingerprint() == published.fingerprint() else None


def _write_hint(
    exc: OSError, folder: Path, flag: str = "--out", need: str = "whose parent is a directory or can be made one"
) -> str:
    """What to do when writing into ``folder`` (``--out``'s parent, the ``--checkpoint-path``
    root) failed with ``exc``; ``need``: what ``flag`` must name instead."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"a full disk or quota: free room in {folder} or name another {flag}"
    if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"{folder} is read-only or not writable by this user: name another {flag}"
    a_flag = ("an " if flag.lstrip("-")[:1] in ("a", "e", "i", "o", "u") else "a ") + flag
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return f"a part of {folder} is not a directory: name {a_flag} {need}"
    if exc.errno == errno.ENOENT:
        return f"a part of {folder} is missing and cannot be made there: name {a_flag} {need}"
    return f"name another {flag}"


_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})
"""Errors only writing gives (a write to a descriptor names no file)."""


def _writing_failed(exc: OSError, folder: Path, root: Path) -> bool:
    """Whether ``exc`` came from writing into ``folder``: an error only writing gives, or one
    naming a file in ``folder`` and not in the checkpoint ``root`` (which is only read)."""
    filename = exc.filename
    if filename is None:
        return exc.errno in _WRITE_ERRNOS
    name = os.path.abspath(os.fsdecode(filename))
    return _within(name, folder) and not _within(name, root)


def _within(name: str, folder: Path) -> bool:
    top = os.path.abspath(folder)
    return name == top or name.startswith(top.rstrip("/") + "/")


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    out = new_folder_path(args.out, "--out")
    try:
        # stdout is the model's path alone (`MODEL=$(rollout-service make-tiny-model ...)`): what the
        # libraries print while they load (DeepSpeed's accelerator line) goes to stderr
        with contextlib.redirect_stdout(sys.stderr):
            from .tiny_model import make_tiny_model

            path = make_tiny_model(out, tied=args.tied, seed=args.seed)
    except OSError as exc:
        if exc.errno is None or not _about_path(exc, out, area=out.absolute().parent):
            raise  # the model's own messages (an --out that is not empty) name it already
        hint = _write_hint(exc, out.absolute().parent, "--out", "whose parent is a directory or can be made one")
        raise OSError(f"cannot write --out {out}: {exc.strerror or exc} ({hint})") from None
    print(path)
    return 0


def _cmd_liveness(args: argparse.Namespace) -> int:
    from .liveness import check_liveness

    alive, why = check_liveness(args.sglang_url, args.sidecar_url, timeout_s=args.timeout)
    print(("alive: " if alive else "NOT alive: ") + why, file=sys.stdout if alive else sys.stderr)
    return 0 if alive else 1


def _cmd_sglang(args: argparse.Namespace) -> int:
    from .http_auth import check_token
    from .sglang_container import run_sglang

    return run_sglang(list(args.sglang_args or []), check_token(args.sglang_api_key, "--sglang-api-key"))


def _cmd_sidecar(args: argparse.Namespace) -> int:
    from .sidecar.app import run_sidecar

    settings = SIDECAR_SETTINGS.build(args)
    run_sidecar(settings, listening_sockets(settings.host, settings.port, "--host/--port"))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    """``serve``: every setting checked before anything is made or started, then `run_serve`.

    SIGTERM, SIGINT and SIGHUP (`serve.STOP_SIGNALS`) are handled from here on, not only once
    `run_serve` installs its handlers: the set-up can take minutes (``--device auto`` asks torch
    in a child process whether it sees CUDA), and a signal then stops ``serve`` with exit code 0
    too, the probe child killed and the checkpoint root it made removed."""
    previous = _handle_signals(*STOP_SIGNALS)
    try:
        try:
            server, settings, policy, listeners = _serve_setup(args)
        except KeyboardInterrupt:
            signum = _interrupted_by.pop() if _interrupted_by else signal.SIGINT
            print(
                f"interrupted by {signal.Signals(signum).name} during serve's start-up: stopped before SGLang started",
                file=sys.stderr,
            )
            return 0
        return run_serve(server, settings, policy, listeners=listeners)
    finally:
        for sig, replaced in previous.items():
            signal.signal(sig, replaced)


def _handle_signals(*signums: int) -> dict[int, Any]:
    """Make ``signums`` interrupt like Ctrl-C (`_interrupt`) in the main thread; the handlers replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _interrupt) for sig in signums}


def _serve_setup(
    args: argparse.Namespace,
) -> tuple[SGLangServer, SidecarSettings, RestartPolicy, list[socket.socket]]:
    """``serve``'s SGLang server, sidecar settings, restart policy and the sidecar's listening
    sockets, every setting checked first: SGLang's (``--device``, ``--sglang-host``,
    ``--sglang-log``, the arguments after ``--``), the restart budget, the key, the ports (the
    sidecar's is bound here and held, so that SGLang's start-up cannot take it); then the checkpoint
    root is made, the sidecar's settings checked against it, and the server object made (which may
    ask torch about CUDA, for minutes, and makes its temporary log). A failure or a signal after the
    port was bound closes it, and removes what was made for the root."""
    sglang_args, api_key = _one_sglang_api_key(
        list(args.sglang_args or []), SERVE_SIDECAR_SETTINGS.values(args)["sglang_api_key"]
    )
    sglang = {
        **SERVE_SGLANG_SETTINGS.values(args),
        "extra_args": sglang_args,
        "die_with_parent": True,
        "lora": lora_from_args(args),
    }
    config = SGLangServerConfig(**sglang)
    policy = SERVE_RESTART_SETTINGS.build(args)
    sidecar = SERVE_SIDECAR_SETTINGS.values(args)
    port = config.port if config.port is not None else free_port(config.host)
    listeners = _check_serve_ports(
        config.host,
        port,
        sidecar["host"],
        sidecar["port"],
        given=(_port_given(args, "port"), _port_given(args, "sidecar_port")),
    )
    made: list[Path] = []
    try:
        made = _make_root(setting_path(args.checkpoint_path, "--checkpoint-path"), sidecar["root_timeout_s"])
        settings = SERVE_SIDECAR_SETTINGS.build(args, sglang_url=server_url(config.host, port), sglang_api_key=api_key)
        _check_stage(settings)
        server = SGLangServer(**{**sglang, "port": port})
    except BaseException:
        for sock in listeners:
            sock.close()
        for folder in made:  # deepest first; only while empty
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return server, settings, policy, listeners


def _check_stage(settings: SidecarSettings) -> None:
    """Take the stage directory over once (made, owner and content checked, its lock taken) and
    remove what that made, before SGLang starts: one the sidecar would refuse (another user's,
    holding entries it did not make, locked by a running sidecar) is a ValueError naming
    ``--stage-dir``, not a replica found unready after SGLang's start (minutes on a GPU). (What a
    stopped ``serve`` left there is of no use: SGLang starts on its base model.)"""
    if settings.stage_dir is None:
        return
    from .sidecar.staging import Stage, StageError

    try:
        Stage(settings.stage_dir, fallback=settings.stage_fallback).remove()
    except StageError as exc:
        raise ValueError(f"--stage-dir: {exc}") from None


def _make_root(root: Path, bound_s: float) -> list[Path]:
    """Make the checkpoint root ``root`` and its missing parents; the folders made, deepest first.

    Bounded by ``bound_s``: a hung network file system must not keep SGLang from starting (the
    sidecar reports it). Raises ValueError naming ``--checkpoint-path``."""

    def make() -> list[Path]:
        missing, folder = [], root.absolute()
        while not os.path.lexists(folder) and folder != folder.parent:
            missing.append(folder)
            folder = folder.parent
        root.mkdir(parents=True, exist_ok=True)
        return missing

    try:
        _answered, made = answered_within(make, bound_s, "making the root")
    except OSError as exc:
        raise ValueError(
            f"cannot create --checkpoint-path {root}: {exc.strerror or exc}; point it at a"
            " directory (or where one can be created) on the shared checkpoint volume"
        ) from None
    return made or []


def _same_addresses(a: str, b: str) -> bool:
    """Whether servers bound to hosts ``a`` and ``b`` on one port would clash: they share an address
    (a name stands for every address it resolves to, all of which asyncio's servers bind:
    ``localhost`` is 127.0.0.1 and ::1), or one is the wildcard of an address family the other has
    an address in (IPv6 sockets bind IPv6 only, as uvicorn's)."""
    addresses_a, addresses_b = _addresses(a), _addresses(b)
    if addresses_a & addresses_b:
        return True
    for wildcards, others in ((addresses_a, addresses_b), (addresses_b, addresses_a)):
        for wildcard in wildcards & {"0.0.0.0", "::"}:
            if any((":" in address) == (":" in wildcard) for address in others):
                return True
    return False


def _addresses(host: str) -> set[str]:
    """The numeric addresses ``host`` binds; ``{host}`` when it does not resolve (the bind check
    then names it)."""
    try:
        found = {str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return {host}
    return found or {host}


def _one_sglang_api_key(sglang_args: list[str], sidecar_key: str | None) -> tuple[list[str], str | None]:
    """SGLang's arguments and the key the sidecar sends it: `serve` starts SGLang with the
    sidecar's ``--sglang-api-key`` (``ROLLOUT_SGLANG_API_KEY``), and a key given to SGLang after
    ``--`` (``--api-key KEY``, or an abbreviation SGLang takes) is the sidecar's too, so the key is
    given once. Two different keys, or ``--api-key`` twice after ``--`` (SGLang would take the last
    one), raise ``ValueError`` (every weight update would be refused with 401)."""
    given = sum(arg.split("=", 1)[0] in API_KEY_OPTIONS for arg in sglang_args)
    if given > 1:
        raise ValueError(
            f"SGLang's --api-key is given {given} times after --: give the key once, as --sglang-api-key or"
            " ROLLOUT_SGLANG_API_KEY (serve starts SGLang with it), and not after --"
        )
    key = flag_value(sglang_args, *API_KEY_OPTIONS)
    if not given:
        return (sglang_args + ["--api-key", sidecar_key] if sidecar_key else sglang_args), sidecar_key
    if sidecar_key is not None and key != sidecar_key:
        raise ValueError(
            "SGLang's --api-key (after --) and --sglang-api-key (ROLLOUT_SGLANG_API_KEY) differ, so the"
            " sidecar's weight updates would be refused: give the key once, as --sglang-api-key or"
            " ROLLOUT_SGLANG_API_KEY (serve starts SGLang with it)"
        )
    return sglang_args, key


def _port_given(args: argparse.Namespace, dest: str) -> str:
    """Where ``serve``'s ``--port`` or ``--sidecar-port`` came from, for an error: ``--port from
    ROLLOUT_PORT``, ``--port given``, ``--port by default``."""
    flag = "--" + dest.replace("_", "-")
    source = given_as(args, dest)
    if source is None:
        return f"{flag} by default" if getattr(args, dest) is not None else f"{flag} empty: a free port"
    return f"{flag} given" if source == flag else f"{flag} from {source}"


def _check_serve_ports(
    sglang_host: str, sglang_port: int, host: str, port: int, given: tuple[str, str] = ("", "")
) -> list[socket.socket]:
    """Both servers of ``serve`` can listen where they are told to, before SGLang's minutes of
    start-up (SGLang does not always exit when it cannot bind); the sidecar's listening sockets,
    held from here on (`listening_sockets`). ``given``: where each port came from (`_port_given`)."""
    if sglang_port == port and _same_addresses(sglang_host, host):
        sources = f" ({', '.join(given)})" if all(given) else ""
        raise ValueError(
            f"--port and --sidecar-port are both {port}{sources}: SGLang and the sidecar each need their own"
            " (in serve, --port/ROLLOUT_PORT is SGLang's port and --sidecar-port/ROLLOUT_SIDECAR_PORT the sidecar's)"
        )
    bindable_port(sglang_host, sglang_port, "--sglang-host/--port")
    return listening_sockets(host, port, "--host/--sidecar-port")


Registrar = Callable[[Any, Any], None]
"""Adds one command: called with the subparsers object and `add_env_argument`."""


def build_parser(extra_commands: Sequence[Registrar] = ()) -> argparse.ArgumentParser:
    """The parser of these commands, plus those `extra_commands` register."""
    parser = _CommandsParser(
        prog="rollout-service",
        description="SGLang rollouts for TRL GRPO, synced through safetensors checkpoints on shared storage.",
    )
    parser.add_argument(
        "--log-level",
        dest=_TOP_LOG_LEVEL,
        default=None,
        type=log_level,
        metavar="LEVEL",
        help="logging level (default INFO; also taken after the command, and from ROLLOUT_LOG_LEVEL)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=EnvArgumentParser)

    p = sub.add_parser(
        "publish",
        help="publish an HF model directory as checkpoint step N",
        description="Publish an existing HF model directory (safetensors +"
        " config.json) atomically as <checkpoint-path>/step-<N>. For seeding a"
        " checkpoint root, rolling back, and tests.",
    )
    p.add_argument("--model-dir", required=True, type=path_text, help="HF model directory to publish")
    p.add_argument("--checkpoint-path", required=True, type=path_text, help="checkpoint root directory")
    p.add_argument("--step", required=True, type=STEP, help=f"step number ({range_text(0, MAX_STEP)})")
    p.add_argument(
        "--dtype",
        default=None,
        type=publishable_dtype_argument,
        help=f"convert floating tensors to this dtype ({', '.join(PUBLISHABLE_DTYPES)}, or bf16, fp16, half,"
        " fp32; default: keep each tensor's dtype)",
    )
    p.add_argument(
        "--max-shard-mb",
        type=SHARD_MB,
        default=2048,
        help=f"max shard size in MiB ({range_text(*SHARD_MB_RANGE)}; default 2048)",
    )
    p.set_defaults(func=_cmd_publish)

    p = sub.add_parser(
        "validate",
        help="validate one published checkpoint",
        description="Validate a checkpoint directory by the rules of its kind (a full step; a delta"
        " step: its files and its chain back to its full step, and with --digests or --check-finite"
        " the model it rebuilds, rebuilt in a temporary folder ($TMPDIR); or a LoRA adapter step:"
        " checked against --reference, else its own tensor shapes, and the LoRA limits of"
        " --max-lora-rank and --lora-target-modules); exits 1 with the reason when it is not loadable,"
        " 2 when --reference cannot be read.",
    )
    p.add_argument("dir", type=path_text, help="checkpoint directory (e.g. ROOT/step-00000003)")
    p.add_argument(
        "--reference",
        default=None,
        type=path_text,
        help="model or checkpoint directory whose tensor names/shapes/dtypes must match (default: none; the"
        " step is checked on its own, an adapter step against its own shapes and the LoRA limits)",
    )
    p.add_argument(
        "--exact-dtypes",
        action="store_true",
        help="refuse floating dtypes that differ from --reference's (default: accept them, as the sidecar"
        " does: SGLang casts F64/F32/F16/BF16 on load; integer, boolean and FP8 tensors must always match)",
    )
    # The default since validate accepts what the sidecar accepts; kept for the command lines that pass it.
    p.add_argument("--allow-float-cast", action="store_false", dest="exact_dtypes", help=argparse.SUPPRESS)
    p.add_argument("--digests", action="store_true", help="also re-read every byte and check digests")
    p.add_argument("--check-finite", action="store_true", help="also read every weight and refuse NaN/Inf values")
    p.add_argument(
        "--timeout",
        type=SECONDS,
        default=600.0,
        help=f"give up (INVALID, validation_timeout) after this many seconds ({range_text(*TIMEOUT_S)}; default 600)",
    )
    p.add_argument(
        "--root",
        default=None,
        type=path_text,
        help="checkpoint root that paths must stay inside (default: DIR's parent)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=LORA_RANK,
        default=DEFAULT_MAX_RANK,
        help=f"adapter steps: the largest rank the server serves ({range_text(1, MAX_ADAPTER_RANK)}; default"
        f" {DEFAULT_MAX_RANK}, as `serve --lora`)",
    )
    p.add_argument(
        "--lora-target-modules",
        type=module_list,
        default=DEFAULT_TARGET_MODULES,
        help="adapter steps: comma-separated modules the server serves adapters on, or 'all'"
        f" (default {','.join(DEFAULT_TARGET_MODULES)}, as `serve --lora`)",
    )
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser(
        "materialize",
        help="rebuild any retained full or delta step as a plain HF model directory",
        description="Rebuild step N under ROOT (a full step, or a delta step and the"
        " chain it applies to) as a plain HF model directory OUT: safetensors shards,"
        " index, config.json and the step's manifest.json (no tokenizer: the trainer publishes"
        " none; copy the base model's), every byte checked against the digests of a full"
        " publish, and the model validated as `validate` checks a full step (compared with"
        " its own tensors: any dtype it was published in) before OUT appears (only when"
        " complete; it must not exist). A run that is killed leaves a hidden folder beside OUT,"
        " which the next run into OUT removes. For evaluating a version with"
        " any tool. An adapter step is refused (adapter_step): its folder already is a"
        " PEFT adapter directory for the base model. Exit status: 0 done (a JSON summary on"
        " stdout), 1 the step cannot be rebuilt (`error: cannot materialize STEP under ROOT"
        " (<reason>): ...`, e.g. missing_manifest, delta_corrupt), 2 a usage error or OUT exists or cannot be written.",
    )
    p.add_argument("root", type=path_text, help="checkpoint root (the trainer's checkpoint_path)")
    p.add_argument(
        "--step", required=True, type=STEP, help=f"the step (version) to rebuild ({range_text(0, MAX_STEP)})"
    )
    p.add_argument("--out", required=True, type=path_text, help="new directory to write the model into")
    p.add_argument(
        "--timeout",
        type=SECONDS,
        default=None,
        help=f"give up after this many seconds ({range_text(*TIMEOUT_S)}; default: no limit)",
    )
    p.set_defaults(func=_cmd_materialize)

    p = sub.add_parser(
        "make-tiny-model",
        help="build the tiny local test model",
        description="Build a tiny deterministic Qwen2 model with a locally trained tokenizer (no model hub needed).",
    )
    p.add_argument("--out", required=True, type=path_text, help="output directory (new, or an empty folder)")
    p.add_argument("--tied", action="store_true", help="tie input and output embeddings")
    p.add_argument(
        "--seed", type=SEED, default=0, help=f"seed of the random weights ({range_text(*SEED_RANGE)}; default 0)"
    )
    p.set_defaults(func=_cmd_make_tiny_model)

    p = sub.add_parser(
        "liveness",
        help="liveness probe for SGLang that knows about weight loads",
        description="Exit 0 when SGLang is alive: its /health answers, or the sidecar"
        " reports a weight load in flight (SGLang's /health then waits on the load, so"
        " a plain /health probe would restart SGLang in the middle of a large load)."
        " Exit 1 otherwise. For Kubernetes exec liveness probes.",
    )
    p.add_argument("--sglang-url", default="http://127.0.0.1:30000", help="SGLang server (default %(default)s)")
    p.add_argument("--sidecar-url", default="http://127.0.0.1:8100", help="its sidecar (default %(default)s)")
    p.add_argument(
        "--timeout", type=SECONDS, default=8.0, help=f"seconds for each HTTP call ({range_text(*TIMEOUT_S)}; default 8)"
    )
    p.set_defaults(func=_cmd_liveness)

    p = sub.add_parser(
        "sidecar",
        help="watch a checkpoint root and load new checkpoints into a running SGLang",
        description="Watch CHECKPOINT_PATH; validate each newly published step-* checkpoint and load"
        " it into SGLang with /update_weights_from_disk (weight_version = step); acknowledge it over"
        " HTTP and in CHECKPOINT_PATH/acks/REPLICA_ID.json. API: GET /healthz /readyz /status"
        " /wait?version=N&timeout=S /metrics, POST /sync.",
    )
    SIDECAR_SETTINGS.add_to(p)
    p.set_defaults(func=_cmd_sidecar)

    p = sub.add_parser(
        "serve",
        help="start SGLang and its sidecar as one supervised unit (like trl vllm-serve)",
        description="Start an SGLang server on MODEL (CPU or GPU flags chosen for this machine) and"
        " a sidecar that keeps it on the newest checkpoint under CHECKPOINT_PATH. A crashed SGLang"
        " is restarted with back-off and the newest checkpoint re-applied. Arguments after '--' go"
        " to sglang.launch_server verbatim, e.g. `rollout-service serve --model M --checkpoint-path"
        " C -- --tp-size 2`. SGLang is started with --sglang-api-key (ROLLOUT_SGLANG_API_KEY) as its"
        " --api-key, which the sidecar sends.",
    )
    SERVE_SGLANG_SETTINGS.add_to(p)
    SERVE_SIDECAR_SETTINGS.add_to(p)
    SERVE_RESTART_SETTINGS.add_to(p)
    add_lora_flags(p)
    p.set_defaults(func=_cmd_serve, sglang_args=[])

    p = sub.add_parser(
        "sglang",
        help="run SGLang (as a container's command) with its API key kept secret",
        description="Run `python -m sglang.launch_server SGLANG_ARGS` (the arguments after '--') with"
        " --sglang-api-key (ROLLOUT_SGLANG_API_KEY) as its --api-key, given to SGLang in a file only"
        " its user reads rather than on its command line, and SGLang's output copied with every"
        " credential hidden (SGLang logs its arguments, key included, when it starts). Adds"
        " `--log-level-http warning` unless SGLANG_ARGS set it. Forwards SIGTERM/SIGINT/SIGHUP to"
        " SGLang and exits with its status. For the rollout container of the Kubernetes and"
        " docker-compose manifests; `serve` does the same for the SGLang it starts.",
    )
    add_env_argument(
        p,
        "--sglang-api-key",
        help="SGLang's API key (its --api-key; default none: SGLang answers anyone who reaches its port)",
    )
    p.set_defaults(func=_cmd_sglang, sglang_args=[])

    for register in extra_commands:
        register(sub, add_env_argument)
    for command in sub.choices.values():
        add_env_argument(
            command,
            "--log-level",
            type=log_level,
            default="INFO",
            help=f"logging level: {', '.join(LOG_LEVELS)} (also taken before the command)",
        )
    for name in ("serve", "sglang"):
        command = sub.choices[name]
        command.usage = command.format_usage().removeprefix("usage: ").rstrip() + " [-- SGLANG_ARGS ...]"
    return parser


_TOP_LOG_LEVEL = "log_level_before_command"
"""The dest of ``--log-level`` given before the command (``rollout-service --log-level DEBUG serve``)."""


class _CommandsParser(RedactingArgumentParser):
    """The top-level parser: ``--log-level`` is taken before the command and after it (and from
    ``ROLLOUT_LOG_LEVEL``, read by the command's parser); the one after the command wins, then the
    one before, then the variable."""

    def parse_known_args(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        namespace: argparse.Namespace | None = None,
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        before = vars(parsed).pop(_TOP_LOG_LEVEL, None)
        if before is not None and given_as(parsed, "log_level") != "--log-level":
            parsed.log_level = before
        return parsed, extras


def main(argv: list[str] | None = None, extra_commands: Sequence[Registrar] = ()) -> int:
    """Run one command (with `extra_commands` registered too); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:  # `serve ... -- extra SGLang arguments`
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    parser = build_parser(extra_commands)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        hint = ""
        if hasattr(args, "sglang_args"):  # serve, sglang: SGLang's own flags go after "--"
            hint = f" (SGLang's own flags go after '--': rollout-service {args.command} ... -- {' '.join(unknown)})"
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if passthrough:
        if not hasattr(args, "sglang_args"):
            parser.error("arguments after '--' are only accepted by `serve` and `sglang`")
        args.sglang_args = passthrough
    handler = logging.StreamHandler()
    handler.setFormatter(log_formatter())
    logging.basicConfig(level=getattr(logging, args.log_level), handlers=[handler])
    if args.log_level != "DEBUG":  # a line per HTTP call (the sidecar asks SGLang every --health-interval)
        for chatty in QUIET_LOGGERS:
            logging.getLogger(chatty).setLevel(logging.WARNING)
    interruptible = (
        args.command not in SIGNAL_HANDLING_COMMANDS and threading.current_thread() is threading.main_thread()
    )
    previous = {sig: signal.signal(sig, _interrupt) for sig in INTERRUPTING_SIGNALS} if interruptible else {}
    try:
        return int(args.func(args) or 0)
    except (OSError, ValueError) as exc:  # bad paths and values: a message, not a traceback
        text = _os_error_text(exc) if isinstance(exc, OSError) else str(exc)  # no "[Errno 13]" prefix
        print(escape_controls(f"error: {text}"), file=sys.stderr)  # it may quote a name from the root
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (timeout, Kubernetes, systemd): cleaned up on the way out
        signum = _interrupted_by.pop() if _interrupted_by else signal.SIGINT
        print(f"interrupted by {signal.Signals(signum).name}: stopped; nothing half-done was left", file=sys.stderr)
        return 128 + signum
    finally:
        for sig, replaced in previous.items():
            signal.signal(sig, replaced)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""The commands' log lines (``sidecar`` and ``serve`` too: their loggers propagate to the root
handler :func:`main` installs; uvicorn's own loggers keep uvicorn's handlers)."""


def log_formatter() -> logging.Formatter:
    """The formatter of the commands' log lines: :data:`LOG_FORMAT`, each record's message one line
    with its control characters escaped (a name from the root holding a newline and a forged log
    line, or a terminal escape, shows as ``\\n``/``\\x1b``); a traceback follows on lines of its own."""
    return ShownLogFormatter(LOG_FORMAT)


SIGNAL_HANDLING_COMMANDS = {"serve", "sidecar", "sglang"}
"""Commands that stop gracefully on SIGTERM themselves; for the others a SIGTERM (or a SIGHUP: a
closed terminal or SSH session) interrupts like Ctrl-C does, so their clean-up (``finally``: a
work folder removed, ``demo``'s ``serve`` stopped) runs instead of the process dying on the spot
with a full-size hidden folder left behind."""
INTERRUPTING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""The signals that interrupt the other commands like Ctrl-C (exit ``128 + signal``)."""
QUIET_LOGGERS = ("httpx", "httpcore")
"""Loggers that log every HTTP call at INFO: shown at ``--log-level DEBUG`` only."""
_interrupted_by: list[int] = []


def _interrupt(signum: int, frame: FrameType | None) -> None:
    _interrupted_by.append(signum)
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
