"""What SGLang serves: a published step it already holds, and the tensor reference of its model.

Both are read from SGLang's own report (its ``model_path`` and weight version), never from a
request: a restarted sidecar adopts the step SGLang already serves instead of reloading it, and
every checkpoint is checked against the served model's tensor names, shapes and dtypes, because
a checkpoint that does not fit makes SGLang's load raise and kills the server.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..checkpoint_format import CheckpointError, Manifest, step_dir_name
from ..checkpoint_paths import is_inside
from ..checkpoint_reader import TensorSpecs, read_model_specs
from ..protocol import step_for_version
from .sglang_client import ServerView
from .staging import Stage

log = logging.getLogger(__name__)


def adoptable(
    view: ServerView, root: Path, stage: Stage | None, sent: tuple[int, str] | None = None
) -> tuple[int, Manifest, Path] | None:
    """(Blocking: call it in a thread.) For a restarted sidecar beside a server that already
    serves a published step: that step, its manifest and the served path, or None.

    Adoptable when SGLang's ``model_path`` holds a manifest of that step whose fingerprint is
    the published one (a staged copy, ours or another sidecar's), or is a copy in this
    sidecar's own stage. The step directory itself (``--no-stage``) holds what was published
    *now*, which need not be what SGLang read (a step republished since): it is adopted only
    when ``sent`` (the step and fingerprint this sidecar last sent SGLang, or that its ack said
    it served before a restart) is that publication; else the step is loaded again.
    """
    step = step_for_version(view.weight_version)
    if step is None or not view.model_path or not os.path.isdir(view.model_path):
        return None
    served = Path(view.model_path)
    try:
        manifest = Manifest.load(served, root=served.parent)
    except CheckpointError:
        return None
    if manifest.step != step:
        return None
    if stage is None or not stage.owns(served):
        try:
            published = Manifest.load(root / step_dir_name(step), root=root)
        except CheckpointError:
            return None
        # A copy names its source; the step directory itself stands for itself, and only as
        # the publication this sidecar sent SGLang.
        if is_inside(served, root):
            manifest = manifest.as_copy()
            if sent != (step, manifest.source_fingerprint()):
                return None
        if published.fingerprint() != manifest.source_fingerprint():
            return None
    return step, manifest, served


def find_reference(
    view: ServerView, root: Path, stage: Stage | None, reference_dir: Path | None, revision: str | None = None
) -> tuple[TensorSpecs, str] | None:
    """(Blocking.) The served model's tensor specs and where they came from, or None when they
    cannot be learnt (the caller reports it and loads nothing until then).

    In order: ``--reference-dir``; the reference kept in the stage, when SGLang serves a staged
    copy or a step of the root (a checkpoint, not the base model); the local model directory
    SGLang's weights came from (``/model_info``'s ``model_path``), when it lies outside the root
    and the stage; else the model SGLang was started from (``/server_info``'s ``model_path``,
    :attr:`ServerView.launch_model_path`), which fixes the names and shapes every weight update
    must have. A Hub id is looked up as its snapshot in the local cache at ``revision`` (the one
    SGLang was started with).

    Never from a folder of the root: it is untrusted and mutable, so what lies there now need not
    be what SGLang loaded (a step republished with other shapes after SGLang read it would make
    its shapes the reference, and SGLang's load of the next step of those shapes raise). So a
    sidecar restarted with ``--no-stage`` beside an SGLang serving a step of the root learns the
    reference from SGLang's launch model; when that too lies in the root (SGLang was started from
    a published step), or SGLang does not name it, nothing is learnt (``--reference-dir`` is
    needed: a warning says so once).
    """
    if reference_dir is not None:
        return read_model_specs(reference_dir), str(reference_dir)
    model_path = view.model_path
    persisted = stage.load_reference() if stage is not None else None
    ours = stage is not None and stage.owns(model_path)
    in_root = model_path is not None and _folder_inside(model_path, root)
    if persisted is not None and (ours or in_root):
        return persisted
    if model_path and not ours and not in_root:
        local = local_model_dir(model_path, revision)
        if local is not None:
            return read_model_specs(local), str(local)
    launch = view.launch_model_path
    if launch and _folder_inside(launch, root):
        _warn_once(
            f"SGLang was started from {launch}, a folder of the checkpoint root {root}: what lies there"
            " now need not be what SGLang loaded (anyone who can write the root can change it), so the"
            " served model's tensors are not learnt from it; pass --reference-dir with a trusted copy of"
            " that model (or start SGLang from a folder outside the root); nothing is loaded until then"
        )
        return None
    if launch and launch != model_path:
        local = local_model_dir(launch, revision)
        if local is not None:
            return read_model_specs(local), f"{local} (the model SGLang was started from)"
    if in_root:  # the caller's message names the step SGLang serves: say what was looked for
        _warn_once(
            f"SGLang serves {model_path}, a folder of the checkpoint root, whose content now need not be"
            " what SGLang loaded, so the served model's tensors are learnt from the model SGLang was"
            + (
                " started from, which its /server_info does not name (asked again at the next deep health check)"
                if launch is None
                else f" started from, {launch}: not a local model directory, nor a Hub id in this"
                " machine's Hugging Face cache"
            )
            + "; pass --reference-dir with that model's directory; nothing is loaded until then"
        )
    return None


def _folder_inside(model_path: str, root: Path) -> bool:
    """Whether SGLang's ``model_path`` names a folder of the root: an absolute path inside it,
    or a relative one that is a folder inside it from here. A Hub id (``Org/Model``, relative
    and no folder here) is none, wherever the sidecar runs (resolved against a working directory
    inside the root it would look like one, and the served model would never be learnt)."""
    if not (os.path.isabs(model_path) or os.path.isdir(model_path)):
        return False
    return is_inside(model_path, root)


_warned: set[str] = set()
"""Warnings :func:`find_reference` has logged (it is tried again at every pass until it learns)."""


def _warn_once(message: str) -> None:
    if message not in _warned and len(_warned) < 32:
        _warned.add(message)
        log.warning("%s", message)


def base_model_dir(
    view: ServerView, root: Path, stage: Stage | None, reference_dir: Path | None, revision: str | None = None
) -> Path | None:
    """(Blocking.) The local folder of the base model SGLang serves, with which adapters'
    recorded base values are compared (:mod:`~rollout_service.base_values`): ``--reference-dir``,
    else SGLang's ``model_path`` when it is a model folder or a Hub id in the local cache (at
    ``revision``, as :func:`local_model_dir`); None
    while SGLang serves a published step (adapters wait for the base model then)."""
    if reference_dir is not None:
        return reference_dir
    model_path = view.model_path
    if not model_path or (stage is not None and stage.owns(model_path)) or is_inside(model_path, root):
        return None
    return local_model_dir(model_path, revision)


def local_model_dir(model_path: str, revision: str | None = None) -> Path | None:
    """The local folder of SGLang's model: a directory, or a Hub id found in the local HF cache
    at ``revision`` (a branch, tag or commit; None: ``main``, as SGLang resolves it)."""
    if os.path.isdir(model_path):
        return Path(model_path) if any(Path(model_path).glob("*.safetensors")) else None
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        local = Path(
            snapshot_download(
                model_path, revision=revision, local_files_only=True, allow_patterns=["*.safetensors", "*.json"]
            )
        )
    except Exception:  # not cached, not a repo id: no reference from it
        return None
    return local if any(local.glob("*.safetensors")) else None
