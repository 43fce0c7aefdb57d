"""Configuration of one sidecar (from CLI flags or ``ROLLOUT_*`` environment variables)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint_paths import is_inside
from ..cli_env import TIMEOUT_S, bounds_metadata, check_bounds, setting
from ..http_auth import check_token, is_loopback_host
from ..http_urls import check_bind_host, check_http_url
from ..protocol import ACK_INTERVAL_S, REPLICA_ID_PATTERN
from ..user_paths import setting_path
from .root_gate import answered_within

log = logging.getLogger(__name__)

_REPLICA_RE = re.compile(REPLICA_ID_PATTERN, re.ASCII)
"""RFC 1123 host names, and ``_`` as Docker Compose service names have them."""

INTERVAL_S = (0.01, 3600.0)
"""Range of the sidecar's periods (health checks, polling, rescans, acks), in seconds."""


@dataclass
class SidecarSettings:
    """What a sidecar watches, whom it talks to, and how it serves its own API.

    Each field whose metadata is a ``setting`` is also a flag of ``rollout-service sidecar`` (and ``serve``)
    and a ``ROLLOUT_*`` variable, derived from this declaration (see ``rollout_service.cli_env``).
    The other fields are tuning knobs for tests and embedders, not on the command line.
    """

    checkpoint_path: Path = field(
        metadata=setting("--checkpoint-path", "checkpoint root the trainer publishes step-* directories into")
    )
    sglang_url: str = field(metadata=setting("--sglang-url", "SGLang server to load checkpoints into"))
    replica_id: str = field(
        default="",
        metadata=setting(
            "--replica-id",
            "name of this replica in acks/<id>.json and /status (default: HOSTNAME-PORT, PORT being the"
            " sidecar's {port})",
        ),
    )
    poll_interval_s: float | None = field(
        default=None,
        metadata=setting(
            "--poll",
            "poll the checkpoint root every N seconds instead of inotify (NFS, CephFS, Lustre; default:"
            " inotify, plus a listing every --health-interval)",
            bounds=INTERVAL_S,
        ),
    )
    """None: inotify; a number: the polling observer's period."""
    host: str = field(default="127.0.0.1", metadata=setting("--host", "address the sidecar binds to"))
    port: int = field(default=8100, metadata=setting("--port", "port of the sidecar's HTTP API", bounds=(1, 65535)))
    token: str | None = field(
        default=None,
        metadata=setting(
            "--token",
            "token required by POST endpoints ('Authorization: Bearer TOKEN'; default none: anyone who can"
            " reach the port may POST /sync; set one unless the sidecar listens on 127.0.0.1 only)",
        ),
    )
    sglang_api_key: str | None = field(
        default=None,
        metadata=setting(
            "--sglang-api-key",
            "SGLang's API key (its --api-key), sent with every call to it (default none; `serve` starts"
            " SGLang with it)",
        ),
    )
    reference_dir: Path | None = field(
        default=None,
        metadata=setting(
            "--reference-dir",
            "model directory whose tensor names/shapes new checkpoints must match (default:"
            " the model SGLang serves, learnt from its model_path, or the reference the stage kept)",
        ),
    )
    check_digests: bool = field(
        default=False,
        metadata=setting(
            "--check-digests",
            "with --no-stage only: re-read every byte and check digests before SGLang loads the step (slower,"
            " catches bit rot); staging (the default) checks every byte it copies anyway",
        ),
    )
    health_interval_s: float = field(
        default=2.0,
        metadata=setting(
            "--health-interval",
            "seconds between SGLang health checks, and between listings of the checkpoint root",
            bounds=INTERVAL_S,
        ),
    )
    deep_health_interval_s: float = field(
        default=30.0,
        metadata=setting(
            "--deep-health-interval",
            "seconds between SGLang /health calls (each runs a one-token generation)",
            bounds=(INTERVAL_S[0], 86400.0),
        ),
    )
    ack_interval_s: float = field(default=ACK_INTERVAL_S, metadata=bounds_metadata(*INTERVAL_S))
    load_timeout_s: float = field(
        default=1800.0,
        metadata=setting(
            "--load-timeout",
            "seconds to allow one /update_weights_from_disk call; past it SGLang may still be"
            " loading, so no other step is sent for as long again (it is adopted if SGLang finishes"
            " it), and a step timed out twice is rejected (sglang_crashed_on_load)",
            bounds=TIMEOUT_S,
        ),
    )
    request_timeout_s: float = field(default=10.0, metadata=bounds_metadata(*TIMEOUT_S))
    stage: bool = field(
        default=True,
        metadata=setting(
            "--no-stage",
            "let SGLang read checkpoints straight from shared storage (no copy; a writer can"
            " then change files between validation and SGLang's read)",
        ),
    )
    """Copy and verify each checkpoint node-locally before SGLang reads it (closes the
    time-of-check/time-of-use window; see ``sidecar/staging.py``)."""
    stage_dir: Path | None = field(
        default=None,
        metadata=setting(
            "--stage-dir",
            "node-local folder of its own (one per replica; a new or empty one, outside the checkpoint"
            " root) where each checkpoint is copied and every byte verified before SGLang reads it; it"
            " needs room for two copies of the model, three while a replica more than one delta behind"
            " catches up (default: /dev/shm/rollout-stage-REPLICA when /dev/shm has 8 GiB free, else"
            " $XDG_CACHE_HOME (default ~/.cache)/rollout-service/stage/REPLICA; the former moves to the"
            " latter at the first step that does not fit in /dev/shm)",
        ),
    )
    """None with stage=True: /dev/shm when it has room, else $XDG_CACHE_HOME (default ~/.cache).
    Never the checkpoint root, inside it or around it (see :func:`stage_dir_conflict`)."""
    stage_max_gb: float | None = field(
        default=None,
        metadata=setting(
            "--stage-max-gb",
            "most GiB the stage may hold (its copies together), below what its file system has free;"
            " set it under a Kubernetes emptyDir's sizeLimit, past which the pod is evicted (default:"
            " no limit but the file system's)",
            bounds=(0.01, 1 << 20),
        ),
    )
    check_finite: bool = field(
        default=True,
        metadata=setting(
            "--no-check-finite",
            "do not refuse NaN/Inf weights (checked on bytes that staging or --check-digests reads anyway)",
        ),
    )
    """Refuse NaN/Inf weights (checked on the bytes the stage or digest mode reads anyway)."""
    validate_timeout_s: float = field(
        default=600.0,
        metadata=setting(
            "--validate-timeout",
            "seconds one checkpoint's validation (and staging copy) may take before the step is rejected",
            bounds=TIMEOUT_S,
        ),
    )
    root_timeout_s: float = field(
        default=10.0,
        metadata=setting(
            "--root-timeout",
            "seconds one look at the checkpoint root (a listing, a manifest, the ack file) may take"
            " before the root counts as not answering: /readyz turns 503 with root_unresponsive, the"
            " replica keeps serving what it loaded, and checks again at each pass (raise it if listing"
            " the root legitimately takes longer)",
            bounds=TIMEOUT_S,
        ),
    )
    lora_keep: int = field(
        default=3,
        metadata=setting(
            "--lora-keep",
            "LoRA adapter versions kept loaded in SGLang (adapter sync); older ones are unloaded"
            " once no request uses them. At least the trainer's max_staleness + 1",
            bounds=(1, 1000),
        ),
    )

    def __post_init__(self) -> None:
        # Absolute from here on: paths built from the root are confined to it by resolve_inside,
        # which reads a relative path as relative to the root (a relative root would double).
        self.checkpoint_path = setting_path(self.checkpoint_path, "--checkpoint-path")
        check_bounds(self)  # every number: finite and in its declared range, or a ValueError naming its flag
        check_bind_host(self.host, "--host")
        check_token(self.token, "--token")
        check_token(self.sglang_api_key, "--sglang-api-key")
        if not self.replica_id:
            self.replica_id = f"{socket.gethostname()}-{self.port}"
        if not _REPLICA_RE.fullmatch(self.replica_id):
            raise ValueError(
                f"replica id {self.replica_id!r} is not usable as a file name: use letters, digits,"
                " '.', '_' and '-' (at most 128 characters)"
            )
        self.sglang_url = check_http_url(self.sglang_url, "--sglang-url")
        if self.reference_dir is not None:
            self.reference_dir = setting_path(self.reference_dir, "--reference-dir")
        self.stage_fallback: Path | None = None
        """Where the stage moves when a step does not fit in it (see ``Stage``): the local-disk
        default, set only when ``--stage-dir`` was not given and /dev/shm was chosen at start-up,
        before the model's size is known. None: the stage stays where it is (a given ``--stage-dir``
        is the user's choice: a step that does not fit there is refused, saying so). Derived, not a
        field: no flag sets it."""
        if not self.stage:
            if self.stage_dir is not None:
                raise ValueError(
                    f"--no-stage and --stage-dir {self.stage_dir} are both given (ROLLOUT_NO_STAGE,"
                    " ROLLOUT_STAGE_DIR): without a stage SGLang reads the checkpoint root and no stage"
                    " directory is used; drop --stage-dir to load from the root, or --no-stage to stage"
                )
        elif self.stage_dir is None:
            from .stage_folder import is_default_shm_stage
            from .staging import default_stage_dir, disk_stage_dir

            self.stage_dir = default_stage_dir(self.replica_id)
            if is_default_shm_stage(self.stage_dir):
                with contextlib.suppress(ValueError):  # no home for it: the stage stays in /dev/shm
                    self.stage_fallback = disk_stage_dir(self.replica_id)
        else:
            self.stage_dir = setting_path(self.stage_dir, "--stage-dir")
        self._check_root()

    def _check_root(self) -> None:
        """The root and ``--reference-dir`` (when given) are directories and the stage is a
        folder of its own (see :func:`stage_dir_conflict`); looked at for at most
        ``root_timeout_s`` (a hung network file system: start anyway, ``/readyz`` says why
        nothing loads, and the stage is checked on the paths as written)."""
        root, stage, reference = self.checkpoint_path, self.stage_dir, self.reference_dir

        def look() -> tuple[str, bool, str | None]:
            reference_ok = reference is None or reference.is_dir()
            root_is = "a directory" if root.is_dir() else "missing" if not os.path.lexists(root) else "other"
            return root_is, reference_ok, stage_dir_conflict(stage, root, reference, is_inside)

        answered, found = answered_within(look, self.root_timeout_s, "checking the root")
        if not answered or found is None:
            log.warning(
                "checkpoint path %s or --reference-dir did not answer within --root-timeout %g s; starting anyway",
                root,
                self.root_timeout_s,
            )
            found = ("a directory", True, stage_dir_conflict(stage, root, reference, _inside_as_written))
        root_is, reference_ok, conflict = found
        if root_is != "a directory":
            what = "does not exist" if root_is == "missing" else "is not a directory"
            raise ValueError(
                f"--checkpoint-path (ROLLOUT_CHECKPOINT_PATH) {root} {what}; create it or mount the shared"
                " checkpoint volume there"
            )
        if not reference_ok:
            raise ValueError(
                f"--reference-dir {reference} is not a directory: give the folder of the model SGLang serves, as"
                " this machine sees it (or leave it unset: the sidecar then reads SGLang's model_path)"
            )
        if conflict:
            raise ValueError(conflict)
        if self.stage_fallback is not None and stage_dir_conflict(
            self.stage_fallback, root, reference, _inside_as_written
        ):
            self.stage_fallback = None  # not a folder of its own (the root under ~/.cache?): the stage stays put


def unguarded_listeners(settings: SidecarSettings, sglang_host: str | None = None) -> list[str]:
    """What listens beyond this machine without credentials: the sidecar on a ``--host`` that is no
    loopback address without ``--token`` and, for ``serve`` (``sglang_host``: the ``--sglang-host``
    it starts SGLang on), SGLang on one without an API key. One warning each, for
    :func:`warn_unguarded_listeners`; none where the deploy files' secrets are set (variables too)."""
    found = []
    if not is_loopback_host(settings.host) and not settings.token:
        found.append(
            f"the sidecar listens on {settings.host} without a token: anyone who can reach it can trigger"
            " syncs. Set --token (or ROLLOUT_TOKEN)."
        )
    if sglang_host is not None and not is_loopback_host(sglang_host) and not settings.sglang_api_key:
        found.append(
            f"SGLang listens on {sglang_host} without an API key: anyone who can reach it can generate and"
            " POST /update_weights_from_disk with any path, past the sidecar's checks. Set --sglang-api-key"
            " (or ROLLOUT_SGLANG_API_KEY): serve starts SGLang with it."
        )
    return found


def warn_unguarded_listeners(settings: SidecarSettings, sglang_host: str | None = None) -> None:
    """Log a warning for each server that listens beyond this machine without credentials
    (:func:`unguarded_listeners`): started anyway, as a trusted network may intend."""
    for message in unguarded_listeners(settings, sglang_host):
        log.warning("%s", message)


SHARED_FOLDERS = ("/", "/tmp", "/var/tmp", "/dev/shm")
"""Folders other programs keep files in: never a stage themselves (``$HOME`` neither)."""


def stage_dir_conflict(
    stage: Path | None, root: Path, reference: Path | None, inside: Callable[[Path | str, Path | str], bool]
) -> str | None:
    """Why ``stage`` cannot be this sidecar's ``--stage-dir``, or None. The stage removes the
    copies it made there, so it must be a folder of its own: not inside the checkpoint root
    (shared, untrusted), not a folder that holds the root or ``--reference-dir`` (the model
    SGLang serves; its own model path is learnt only once it answers, and the stage then
    refuses a folder it did not make), and not a folder other programs use (``/``, ``/tmp``,
    ``/dev/shm``, ``$HOME``, a folder above ``$HOME``). ``inside(path, folder)``: whether
    ``path`` lies in ``folder`` or is it."""
    if stage is None:
        return None
    own = f"; give each replica a node-local folder of its own, e.g. {stage / 'rollout-stage'}"
    if inside(stage, root):
        return f"--stage-dir {stage} is inside the checkpoint root; it must be node-local and private to this sidecar"
    if inside(root, stage):
        return f"--stage-dir {stage} holds the checkpoint root (--checkpoint-path {root}){own}"
    if reference is not None and inside(reference, stage):
        return f"--stage-dir {stage} holds --reference-dir {reference} (the model SGLang serves){own}"
    home = _home()
    if any(inside(stage, shared) and inside(shared, stage) for shared in SHARED_FOLDERS) or (
        home is not None and inside(home, stage)
    ):
        return f"--stage-dir {stage} is a folder other programs keep files in{own}"
    return None


def _home() -> Path | None:
    try:
        return Path.home()
    except (RuntimeError, KeyError):
        return None


def _inside_as_written(path: Path | str, folder: Path | str) -> bool:
    """``is_inside`` on the absolute paths as written, links not resolved (a root that hangs)."""
    return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(folder))
