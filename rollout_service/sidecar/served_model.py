"""What SGLang serves: a published step it already holds, and the tensor reference of its model.

Both are read from SGLang's own report (its ``model_path`` and weight version), never from a
request: a restarted sidecar adopts the step SGLang already serves instead of reloading it, and
every checkpoint is checked against the served model's tensor names, shapes and dtypes, because
a checkpoint that does not fit makes SGLang's load raise and kills the server.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..checkpoint_format import CheckpointError, Manifest, parse_step_dir_name, step_dir_name
from ..checkpoint_paths import is_inside
from ..checkpoint_reader import TensorSpecs, published_step_specs, read_model_specs
from ..protocol import step_for_version
from .sglang_client import ServerView
from .staging import Stage

STEP_REFERENCE_TIMEOUT_S = 60.0
"""Reading a served step's headers for its tensor list (its bytes are not read)."""


def adoptable(view: ServerView, root: Path, stage: Stage | None) -> tuple[int, Manifest, Path] | None:
    """(Blocking: call it in a thread.) For a restarted sidecar beside a server that already
    serves a published step: that step, its manifest and the served path, or None.

    Adoptable when SGLang's ``model_path`` holds a manifest of that step whose fingerprint is
    the published one (a staged copy, ours or another sidecar's, or the step directory
    itself), or is a copy in this sidecar's own stage.
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
        # The step directory itself (no stage) stands for itself; a copy names its source.
        source = manifest.as_copy() if is_inside(served, root) else manifest
        if published.fingerprint() != source.source_fingerprint():
            return None
    return step, manifest, served


def find_reference(
    view: ServerView, root: Path, stage: Stage | None, reference_dir: Path | None, revision: str | None = None
) -> tuple[TensorSpecs, str] | None:
    """(Blocking.) The served model's tensor specs and where they came from, or None when they
    cannot be learnt (the caller reports it and loads nothing until then).

    In order: ``--reference-dir``; the reference kept in the stage, when SGLang serves a staged
    copy or a step of the root (a checkpoint, not the base model); for a step of the root served
    without a stage (``--no-stage``), that step read as a checkpoint (its manifest's files, their
    headers checked: never whatever else lies in the untrusted folder); the local model directory
    SGLang was started from (a Hub id: its snapshot in the local cache at ``revision``, the
    one SGLang was started with).
    """
    if reference_dir is not None:
        return read_model_specs(reference_dir), str(reference_dir)
    model_path = view.model_path
    persisted = stage.load_reference() if stage is not None else None
    ours = stage is not None and stage.owns(model_path)
    in_root = model_path is not None and is_inside(model_path, root)
    if persisted is not None and (ours or in_root):
        return persisted
    if model_path and in_root and not ours and _is_step_dir(model_path, root):
        try:
            specs = published_step_specs(model_path, root=root, timeout_s=STEP_REFERENCE_TIMEOUT_S)
        except CheckpointError:
            return None
        return specs, f"{model_path} (the published step SGLang serves: its manifest's shards)"
    if model_path and not ours:
        local = local_model_dir(model_path, revision)
        if local is not None:
            return read_model_specs(local), str(local)
    return None


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


def _is_step_dir(path: str, root: Path) -> bool:
    """``path`` names a step directory right under ``root`` (not, say, a base model kept there)."""
    p = Path(path)
    return parse_step_dir_name(p.name) is not None and os.path.abspath(p.parent) == os.path.abspath(root)
