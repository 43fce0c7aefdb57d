"""Validating an ``adapter`` checkpoint step against the model and LoRA limits SGLang serves.

SGLang 0.5.23 either refuses an adapter it cannot serve or, worse, serves something else: it
ignores ``modules_to_save``, scales every adapter by ``lora_alpha / r`` (no rsLoRA, no per-module
ranks) and drops LoRA weights of modules it was not started for. :func:`validate_adapter` refuses
all of those before SGLang sees the adapter, each with a reason code, and checks what a load
would trip over: the files (exactly ``adapter_config.json`` and ``adapter_model.safetensors``, the
sizes of the manifest), the config (strict JSON, the manifest's rank/alpha/modules), every tensor
(a ``lora_A``/``lora_B`` of a module the served model has, of a dtype in :data:`ADAPTER_DTYPES`,
shapes ``[r, in]`` / ``[out, r]``), the rank against ``--max-lora-rank`` and the modules against
``--lora-target-modules``. :func:`adapter_support_problem` is the same judgement on a PEFT config
and :func:`check_adapter_tensors` on a PEFT state dict, for the trainer's choice between adapter
sync and merged sync. Everything under the root is untrusted.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checkpoint_format import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_FILES,
    ADAPTER_WEIGHTS_NAME,
    MANIFEST_NAME,
    MAX_ADAPTER_HEADER_BYTES,
    MAX_ADAPTER_RANK,
    MAX_TARGET_MODULES,
    MODULE_NAME_RE,
    AdapterInfo,
    CheckpointError,
    Manifest,
    parse_json_object,
    parse_step_dir_name,
    refuse_step_link,
)
from .checkpoint_paths import resolve_inside
from .checkpoint_reader import TensorSpecs, read_every_byte, read_safetensors_specs
from .safetensors_header import count_entries
from .shown_values import shown
from .untrusted_files import NO_DEADLINE, Deadline, any_failure_is_the_steps, open_regular, read_small

PEFT_PREFIX = "base_model.model."
LORA_PARTS = ("lora_A", "lora_B")
UNSERVED_MODULES = frozenset({"embed_tokens", "lm_head"})
"""Modules whose LoRA weights SGLang 0.5.23 lays out otherwise than a linear layer's (an
embedding's ``lora_embedding_A``) or does not serve: such adapters sync merged instead."""
MODEL_CHANGING_KEYS = (
    "layer_replication",
    "target_parameters",
    "use_qalora",
    "lora_bias",
    "trainable_token_indices",
    "alora_invocation_tokens",
    "arrow_config",
    "kasa_config",
    "monteclora_config",
    "use_bdlora",
)
"""PEFT options that, when set, make the trained model differ from base + ``alpha/r * B @ A`` on
the target modules, which is all SGLang serves. PEFT 0.21's LoRA variants among them: aLoRA
(``alora_invocation_tokens``) applies the adapter only to the tokens after its invocation tokens,
SGLang to every token; Arrow routes between adapters; KaSA truncates the base weights' smallest
singular components and adds a learned diagonal; MonteCLoRA samples perturbations of ``lora_A``
in every forward; BD-LoRA makes ``lora_A`` or ``lora_B`` block-diagonal."""
BASE_KEEPING_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica")
"""The ``init_lora_weights`` values that leave the base weights as they are (PEFT 0.21's
``LoraLayer.update_layer``; MiCA only freezes ``lora_B``, its forward is plain LoRA's): the others
(``pissa``, ``pissa_niter_<n>``, ``olora``, ``corda``, ``loftq``, ``lora_ga``) subtract the
adapter's starting product from the base weights, or quantize them, so the trainer trains on
another base than the one SGLang serves, and a value of a later PEFT is not known to keep them.
Those adapters sync merged."""
CASELESS_INITS = ("gaussian", "mica")
"""The ``init_lora_weights`` values PEFT 0.21 compares lowercased (``"Gaussian"`` is Gaussian)."""
ADAPTER_DTYPES = ("F32", "F16", "BF16")
"""The dtypes of LoRA weights (safetensors tags), defined once: the only ones ``adapter_writer``
publishes and the only ones readers accept (``dtype_unloadable``). PEFT trains adapters in these;
an fp8 or fp64 adapter is nothing the trainer writes, and not what SGLang's LoRA serving was
tested with."""
MAX_LORA_ALPHA = 1e6
"""``lora_alpha`` is below it (and above 0), as the manifest's ``adapter.alpha`` is: PEFT's
values are tens to hundreds; a config's number past it is junk, not a scale to serve."""


@dataclass(frozen=True)
class LoraLimits:
    """What one SGLang server can serve (its ``--enable-lora`` flags, from ``/server_info``)."""

    enabled: bool
    max_rank: int | None
    target_modules: frozenset[str] = field(default_factory=frozenset)
    """Empty with ``enabled``: SGLang infers them (only from adapters given at start-up)."""

    @classmethod
    def from_server_info(cls, info: Mapping[str, Any]) -> LoraLimits:
        """The limits in SGLang's ``/server_info`` answer (untrusted JSON).

        SGLang 0.5.23 sends ``enable_lora`` as a bool or null, ``max_lora_rank`` as an integer or
        null, ``lora_target_modules`` as a list of module names or null, ``lora_paths`` as a list
        (or dict) or null. Anything else raises ValueError: the answer is unreadable, as one that
        is not JSON (the trainer then syncs merged checkpoints and logs why).
        """
        if not isinstance(info, Mapping):
            raise ValueError(f"/server_info is not a JSON object: {shown(info)}")
        enabled = info.get("enable_lora")
        if enabled is not None and not isinstance(enabled, bool):
            raise ValueError(f"/server_info enable_lora={shown(enabled)} is not true, false or null")
        paths = info.get("lora_paths")
        if paths is not None and not isinstance(paths, (list, dict, str)):
            raise ValueError(f"/server_info lora_paths={shown(paths)} is not a list, an object or null")
        rank = info.get("max_lora_rank")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise ValueError(f"/server_info max_lora_rank={shown(rank)} is not a positive integer or null")
        modules = info.get("lora_target_modules")
        if isinstance(modules, str):
            modules = [modules]
        if modules is not None and (
            not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules)
        ):
            raise ValueError(f"/server_info lora_target_modules={shown(modules)} is not a list of module names or null")
        return cls(
            enabled=bool(enabled) or bool(paths),
            max_rank=rank,
            target_modules=frozenset(modules or ()),
        )

    def serves_module(self, module: str) -> bool:
        """Whether SGLang serves LoRA on ``module``: compared as SGLang compares them, by the
        name of the layer it fuses the module into (:data:`FUSED_MODULES`), so ``q_proj`` is
        served by ``--lora-target-modules qkv_proj`` and ``k_proj`` by ``q_proj v_proj``."""
        if "all" in self.target_modules:
            return True
        return fused_name(module) in {fused_name(m) for m in self.target_modules}


FUSED_MODULES = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
"""The layers SGLang 0.5.23 fuses these modules into, and by whose names it checks an adapter's
``target_modules`` against its ``--lora-target-modules`` (both sides: ``get_normalized_target_modules``
in ``sglang/srt/lora/utils.py``), for the decoder architectures this project serves."""


def fused_name(module: str) -> str:
    """The name SGLang checks ``module`` by (:data:`FUSED_MODULES`; others as they are)."""
    return FUSED_MODULES.get(module, module)


@dataclass
class AdapterReport:
    """An adapter step that passed validation."""

    path: Path
    manifest: Manifest
    modules: list[str]
    checks: list[str] = field(default_factory=list)


def adapter_support_problem(config: Mapping[str, Any], limits: LoraLimits) -> str | None:
    """Why SGLang with ``limits`` cannot serve an adapter with this PEFT config; None when it can."""
    if not limits.enabled:
        return "the SGLang server was started without LoRA (rollout-service serve --lora)"
    peft_type = str(getattr(config.get("peft_type"), "value", config.get("peft_type")))
    if peft_type != "LORA":
        return f"peft_type is {peft_type}, SGLang serves LoRA only"
    if config.get("use_dora"):
        return "the adapter uses DoRA (use_dora=True), which SGLang does not serve"
    if config.get("modules_to_save"):
        return (
            f"modules_to_save={shown(config['modules_to_save'])} trains whole modules, which SGLang's"
            " LoRA adapters cannot carry"
        )
    for key in MODEL_CHANGING_KEYS:
        if config.get(key):
            return f"{key}={shown(config[key])} changes the model beyond what SGLang's LoRA serving applies"
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() in CASELESS_INITS:
        init = init.lower()  # as PEFT reads them
    if not any(init is keep if isinstance(keep, bool) else init == keep for keep in BASE_KEEPING_INITS):
        return (
            f"init_lora_weights={shown(init)} is not one of {list(BASE_KEEPING_INITS)}, the initializations"
            " that leave the base weights as they are (PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA change them):"
            " the trainer would train on another base than the one SGLang serves"
        )
    if config.get("use_rslora"):
        return "use_rslora=True scales by alpha/sqrt(r); SGLang scales every adapter by alpha/r"
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        return "rank_pattern/alpha_pattern give modules their own rank or alpha; SGLang uses one per adapter"
    if str(config.get("bias", "none")) != "none":
        return f"bias={config.get('bias')!r} trains bias terms, which SGLang's LoRA adapters cannot carry"
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        return f"r={rank!r} is not a positive integer"
    if limits.max_rank is not None and rank > limits.max_rank:
        return f"rank {rank} is above the server's --max-lora-rank {limits.max_rank}"
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < MAX_LORA_ALPHA:
        return f"lora_alpha={shown(alpha)} is not a positive number below {MAX_LORA_ALPHA:g}"
    modules = config.get("target_modules")
    if isinstance(modules, str):
        return (
            f"target_modules={modules!r} is a pattern; give the module names (e.g. ['q_proj', 'v_proj'])"
            " so the server's --lora-target-modules can be checked"
        )
    if (
        not isinstance(modules, (list, tuple, set, frozenset))  # PEFT's LoraConfig holds a set
        or not modules
        or not all(isinstance(m, str) and m for m in modules)
    ):
        return f"target_modules={shown(modules)} is not a list of module names"
    names = module_names(modules)
    problem = target_module_problem(names)
    if problem is not None:
        return problem
    unserved_here = sorted(names & UNSERVED_MODULES)
    if unserved_here:
        return f"target modules {unserved_here}: SGLang's LoRA serves linear layers inside the model only"
    unserved = sorted(m for m in names if not limits.serves_module(m))
    if unserved:
        return (
            f"target modules {unserved} are not among the server's --lora-target-modules"
            f" {sorted(limits.target_modules)}"
        )
    return stacking_problem(names)


def module_names(modules: Any) -> set[str]:
    """Module names as SGLang matches them: PEFT resolves ``all-linear`` to full paths
    (``model.layers.0.mlp.up_proj``); the last component is the module's name."""
    return {str(m).rsplit(".", 1)[-1] for m in modules}


def target_module_problem(names: Collection[str]) -> str | None:
    """Why module names (:func:`module_names`) cannot be an adapter's ``target_modules`` as its
    manifest holds them, which readers parse strictly (``checkpoint_format``: 1 to
    :data:`MAX_TARGET_MODULES` names of letters, digits and ``_``, not starting with a digit);
    None when they can. A layer inside an ``nn.Sequential`` or ``nn.ModuleList`` is named by its
    index: PEFT's ``fc.0`` is module ``0``, which no reader (and no ``--lora-target-modules``)
    takes. Checked on the PEFT config at the trainer's start-up and by :func:`publish_adapter
    <rollout_service.adapter_writer.publish_adapter>`, so such an adapter syncs merged rather than
    being published as a step every replica rejects."""
    odd = sorted(n for n in names if not MODULE_NAME_RE.fullmatch(n))
    if odd:
        return (
            f"target modules {shown(odd)} are not module names SGLang can target (up to 64 letters, digits"
            " and '_', not starting with a digit): a layer inside an nn.Sequential or nn.ModuleList is"
            " named by its index ('fc.0' is module '0'); adapt layers that have names of their own"
        )
    if len(names) > MAX_TARGET_MODULES:
        return f"{len(names)} target modules: an adapter targets at most {MAX_TARGET_MODULES} module names"
    return None


def stacking_problem(modules: set[str]) -> str | None:
    """Module sets SGLang 0.5.23 cannot stack into its fused layers (found on the CPU test bed: the
    scheduler dies at the first request with ``Cannot find target module name for ...up_proj...``,
    or a KeyError for the missing ``v_proj``): it builds ``qkv_proj`` from ``q_proj`` + ``v_proj``
    (``k_proj`` optional in the config) and ``gate_up_proj`` from ``gate_proj`` (``up_proj``
    optional). Whatever the config targets, every adapted block must then hold all of it
    (``_check_every_target_adapted``: SGLang stacks per layer from the tensors it finds)."""
    attention = modules & {"q_proj", "k_proj", "v_proj"}
    if attention and not {"q_proj", "v_proj"} <= attention:
        return (
            f"target modules {sorted(attention)}: SGLang fuses q/k/v and needs q_proj and v_proj both"
            " in an adapter that changes any of them (add the missing one)"
        )
    if "up_proj" in modules and "gate_proj" not in modules:
        return (
            "target module up_proj without gate_proj: SGLang fuses them and cannot serve up_proj alone (add gate_proj)"
        )
    return None


def validate_adapter(
    checkpoint_dir: Path,
    *,
    root: Path,
    reference: TensorSpecs | None,
    limits: LoraLimits,
    check_finite: bool = False,
    check_digests: bool = False,
    timeout_s: float | None = None,
) -> AdapterReport:
    """Validate an ``adapter`` step; raise ``CheckpointError`` naming the first problem.

    ``reference`` is the served model's tensors; None checks the tensors against the base
    weights their own lora_A/lora_B pairs imply (:func:`implied_reference`, for
    :func:`validate_adapter_step`). ``check_digests`` re-reads every byte against the
    manifest's digests (a stage copy is checked while it is copied; without a stage, this is
    the only byte check)."""
    deadline = Deadline(timeout_s) if timeout_s is not None else NO_DEADLINE
    checkpoint_dir = Path(checkpoint_dir)
    refuse_step_link(checkpoint_dir)
    real_dir = resolve_inside(root, checkpoint_dir)
    name = checkpoint_dir.name
    if not real_dir.is_dir():
        raise CheckpointError("missing_checkpoint", f"{name} is not a directory")
    manifest = Manifest.load(real_dir, root=root)
    checks = ["inside root", "manifest parses"]
    step = parse_step_dir_name(name)
    if step is not None and manifest.step != step:
        raise CheckpointError(
            "bad_manifest", f"{name}/manifest.json says step {manifest.step}, the directory says {step}"
        )
    if manifest.kind != "adapter" or manifest.adapter is None:
        raise CheckpointError("not_an_adapter", f"{name} is a {manifest.kind} checkpoint, not an adapter")
    if sorted(manifest.files) != sorted(ADAPTER_FILES):
        raise CheckpointError(
            "bad_manifest",
            f"{name}/manifest.json lists {sorted(manifest.files)[:8]};"
            f" an adapter step holds exactly {list(ADAPTER_FILES)}",
        )
    with os.scandir(real_dir) as entries:  # SGLang's loader would also read other weight files
        extra = sorted(
            e.name for _, e in zip(range(64), entries) if e.name not in ADAPTER_FILES and e.name != MANIFEST_NAME
        )
    if extra:
        raise CheckpointError(
            "unlisted_file",
            f"{name} holds {extra[:4]} beside the adapter; SGLang might"
            " load them. Remove them or republish the adapter",
        )
    for fname, entry in sorted(manifest.files.items()):
        with open_regular(root, real_dir / fname, where=f"{name}/{fname}") as (_, st):
            if st.st_size != entry.size:
                raise CheckpointError(
                    "truncated" if st.st_size < entry.size else "size_mismatch",
                    f"{name}/{fname} has {st.st_size} bytes, the manifest says {entry.size}",
                )
    if manifest.total_bytes != sum(e.size for e in manifest.files.values()):
        raise CheckpointError(
            "size_mismatch",
            f"{name}: files add up to {sum(e.size for e in manifest.files.values())} bytes,"
            f" manifest total_bytes says {manifest.total_bytes}",
        )
    checks.append("files and sizes match the manifest")
    deadline.check(name)
    info = manifest.adapter
    config = parse_json_object(
        read_small(root, real_dir / ADAPTER_CONFIG_NAME, where=f"{name}/{ADAPTER_CONFIG_NAME}"),
        where=f"{name}/{ADAPTER_CONFIG_NAME}",
        reason="bad_adapter_config",
    )
    check_config_matches(config, info, where=f"{name}/{ADAPTER_CONFIG_NAME}")
    problem = adapter_support_problem(config, limits)
    if problem is not None:
        raise CheckpointError("adapter_unservable", f"{name}: {problem}")
    checks.append("config servable")
    weights = f"{name}/{ADAPTER_WEIGHTS_NAME}"
    deadline.check(weights)
    listed = manifest.files[ADAPTER_WEIGHTS_NAME].tensors

    def wrong_count(held: str) -> CheckpointError:
        return CheckpointError(
            "bad_manifest",
            f"{weights} holds {held} tensors; the manifest says {manifest.tensor_count}"
            f" (tensor_count) and {listed} (its file entry)",
        )

    def counted(header: memoryview) -> None:  # before it is parsed: ~100 MB of objects at the cap
        found = count_entries(header, weights, limit=max(manifest.tensor_count, listed))
        if found.count != manifest.tensor_count or found.count != listed:
            raise wrong_count(f"{found.count}{'' if found.complete else ' or more'}")

    specs = read_safetensors_specs(
        real_dir / ADAPTER_WEIGHTS_NAME, root=root, max_header_bytes=MAX_ADAPTER_HEADER_BYTES, check=counted
    )
    deadline.check(weights)
    if manifest.tensor_count != len(specs) or listed != len(specs):  # a name given twice: safetensors keeps one
        raise wrong_count(str(len(specs)))
    odd_dtype = sorted(t for t, (dtype, _) in specs.items() if manifest.dtype is not None and dtype != manifest.dtype)
    if odd_dtype:
        raise CheckpointError(
            "dtype_mismatch",
            f"{weights}: {odd_dtype[0][:120]!r} is {specs[odd_dtype[0]][0]}, the manifest says {manifest.dtype}",
        )
    served = reference if reference is not None else implied_reference(specs)
    check_adapter_tensors(specs, served, info.rank, set(info.target_modules), where=weights)
    checks.append("tensors fit the served model")
    if check_digests or check_finite:
        for fname, entry in sorted(manifest.files.items()):
            finite = check_finite and fname == ADAPTER_WEIGHTS_NAME
            read_every_byte(root, real_dir / fname, f"{name}/{fname}", entry.digest, check_digests, finite, deadline)
        checks += [c for c, done in (("digests match", check_digests), ("finite", check_finite)) if done]
    return AdapterReport(path=real_dir, manifest=manifest, modules=sorted(info.target_modules), checks=checks)


SELF_CHECKED = "tensors are lora_A/lora_B pairs of the manifest's rank (no reference: not checked against a model)"
"""The check :func:`validate_adapter_step` reports in place of "tensors fit the served model"."""


def validate_adapter_step(
    checkpoint_dir: Path | str,
    *,
    root: Path | str | None = None,
    reference: TensorSpecs | None = None,
    limits: LoraLimits,
    check_finite: bool = False,
    check_digests: bool = False,
    timeout_s: float | None = None,
) -> AdapterReport:
    """:func:`validate_adapter` for a step someone names (``rollout-service validate``).

    Like :func:`~rollout_service.checkpoint_reader.validate_checkpoint`: ``root`` defaults to
    the step's parent, and every failure, whatever raised it, is a ``CheckpointError``. Without
    ``reference`` (no base model at hand) the tensors are checked against the base weights their
    own lora_A/lora_B pairs imply: names, pairing, the manifest's rank and float dtypes, but not
    that the model has those layers; a tensor that fails it is ``bad_adapter``."""
    checkpoint_dir = Path(checkpoint_dir).absolute()  # a relative root would double (resolve_inside)
    real_root = Path(root).absolute() if root is not None else checkpoint_dir.parent
    try:
        with any_failure_is_the_steps(checkpoint_dir.name, "adapter"):
            report = validate_adapter(
                checkpoint_dir,
                root=real_root,
                reference=reference,
                limits=limits,
                check_finite=check_finite,
                check_digests=check_digests,
                timeout_s=timeout_s,
            )
    except CheckpointError as exc:
        if reference is None and exc.reason == "adapter_mismatch":
            raise CheckpointError(
                "bad_adapter", f"{exc} (checked without a reference model, against its own lora_A/lora_B shapes)"
            ) from None
        raise
    if reference is None:
        report.checks = [SELF_CHECKED if c == "tensors fit the served model" else c for c in report.checks]
    return report


def implied_reference(specs: TensorSpecs) -> TensorSpecs:
    """The base weights an adapter's tensors (``specs``, its header) imply: ``[out, in]`` from
    lora_B's rows and lora_A's columns (1 where the partner is missing, which
    :func:`check_adapter_tensors` then reports as unpaired). Derived from the header
    :func:`validate_adapter` reads anyway, so a step checked without a reference model has its
    header parsed once."""
    dims: dict[str, list[int]] = {}
    for tname, (_, shape) in specs.items():
        base, _, tail = tname.rpartition(".")
        module_path, _, part = base.rpartition(".")
        if tname.startswith(PEFT_PREFIX) and tail == "weight" and part in LORA_PARTS and len(shape) == 2:
            served = dims.setdefault(module_path[len(PEFT_PREFIX) :] + ".weight", [1, 1])
            if part == "lora_A":
                served[1] = shape[1]
            else:
                served[0] = shape[0]
    return {served: ("F32", (out_dim, in_dim)) for served, (out_dim, in_dim) in dims.items()}


def check_config_matches(config: Mapping[str, Any], info: AdapterInfo, where: str) -> None:
    """The adapter's own config says what its manifest says: rank, alpha and target modules
    (SGLang reads the config, the sidecar judged the manifest). ``adapter_writer`` checks the
    config it writes with it too."""
    rank = _config_number(config, "r", where, below=MAX_ADAPTER_RANK + 1, integer=True)
    alpha = _config_number(config, "lora_alpha", where, below=MAX_LORA_ALPHA)
    if rank != info.rank or float(alpha) != info.alpha:
        raise CheckpointError(
            "bad_adapter_config",
            f"{where} has r={rank}, lora_alpha={alpha}; the manifest says {info.rank}, {info.alpha}:"
            " republish the adapter (its config and manifest are written together)",
        )
    modules = config.get("target_modules")
    if not isinstance(modules, list) or module_names(modules) != set(info.target_modules):
        raise CheckpointError(
            "bad_adapter_config", f"{where} targets {shown(modules)}; the manifest says {info.target_modules}"
        )


def _config_number(config: Mapping[str, Any], key: str, where: str, *, below: float, integer: bool = False) -> float:
    """``config[key]``, when it is a number (an integer with ``integer``) above 0 and below
    ``below``; otherwise ``CheckpointError('bad_adapter_config')`` naming the field. The range
    is checked before any conversion: JSON numbers have no size limit (``1e999`` parses as
    inf, and ``float()`` of the integer ``10**400`` raises ``OverflowError``)."""
    value = config.get(key)
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value < below:
        raise CheckpointError(
            "bad_adapter_config",
            f"{where} has {key}={shown(value)}: it must be {'an integer' if integer else 'a number'} above 0"
            f" and below {below:g}, as PEFT writes it; republish the adapter",
        )
    return value


def check_adapter_tensors(specs: TensorSpecs, reference: TensorSpecs, rank: int, modules: set[str], where: str) -> None:
    """``CheckpointError`` unless ``specs`` (an adapter's tensors: name -> dtype, shape) are
    ``lora_A``/``lora_B`` pairs of ``modules`` in the model ``reference`` describes, of the dtypes
    in :data:`ADAPTER_DTYPES` and the shapes ``rank`` gives, each adapted block whole
    (:func:`_check_every_target_adapted`). The sidecar's check of a published step, and the
    trainer's of its PEFT state dict at start-up: an adapter it fails syncs merged instead of
    being rejected by every replica."""
    if not specs:
        raise CheckpointError("bad_adapter", f"{where} holds no tensors")
    seen: set[str] = set()
    for tname, (dtype, shape) in specs.items():
        base, _, tail = tname.rpartition(".")
        module_path, _, part = base.rpartition(".")
        if not tname.startswith(PEFT_PREFIX) or tail != "weight" or part not in LORA_PARTS:
            raise CheckpointError(
                "bad_adapter",
                f"{where}: tensor {tname[:120]!r} is not a LoRA weight"
                " ('base_model.model.<module>.lora_A.weight' or lora_B)",
            )
        module = module_path.rsplit(".", 1)[-1]
        if module not in modules:
            raise CheckpointError(
                "bad_adapter",
                f"{where}: tensor {tname[:120]!r} belongs to {module!r},"
                f" not one of the adapter's target modules {sorted(modules)}",
            )
        served = module_path[len(PEFT_PREFIX) :] + ".weight"
        if served not in reference:
            raise CheckpointError(
                "adapter_mismatch",
                f"{where}: {tname[:120]!r} adapts {served!r}, which the"
                " served model does not have (an adapter for another model?)",
            )
        if len(reference[served][1]) != 2 or not all(reference[served][1]):
            raise CheckpointError(
                "adapter_mismatch",
                f"{where}: {tname[:120]!r} adapts {served!r} {list(reference[served][1])}, which is not a"
                " linear layer's weight (LoRA serves 2-D weights)",
            )
        if dtype not in ADAPTER_DTYPES:
            raise CheckpointError(
                "dtype_unloadable",
                f"{where}: {tname[:120]!r} is {str(dtype)[:20]}; LoRA weights must be one of"
                f" {list(ADAPTER_DTYPES)}, as adapters are published: republish the adapter in one of them",
            )
        out_dim, in_dim = reference[served][1]
        want = (rank, in_dim) if part == "lora_A" else (out_dim, rank)
        if tuple(shape) != want:
            raise CheckpointError(
                "adapter_mismatch",
                f"{where}: {tname[:120]!r} is {dtype} {list(shape)};"
                f" for {served} {list(reference[served][1])} at rank {rank} it must be of shape {list(want)}",
            )
        seen.add(f"{module_path}.{part}")
    unpaired = sorted(
        p for p in seen if p.replace("lora_A", "lora_B") not in seen or p.replace("lora_B", "lora_A") not in seen
    )
    if unpaired:
        raise CheckpointError("bad_adapter", f"{where}: {unpaired[0][:120]!r} has no matching lora_A/lora_B")
    _check_every_target_adapted(seen, reference, modules, where)


def _check_every_target_adapted(seen: set[str], reference: TensorSpecs, modules: set[str], where: str) -> None:
    """Wherever the adapter changes a block (``...layers.3.self_attn``), it holds every target
    module the served model has there: SGLang stacks q/k/v and gate/up per layer from what the
    adapter holds, and one missing makes its scheduler die at the first request."""
    adapted: dict[str, set[str]] = {}
    for part in seen:
        block, _, module = part.rsplit(".", 1)[0].rpartition(".")
        adapted.setdefault(block, set()).add(module)
    for block, present in sorted(adapted.items()):
        served_block = block[len(PEFT_PREFIX) :]
        expected = {m for m in modules if f"{served_block}.{m}.weight" in reference}
        if present != expected:
            missing = sorted(expected - present)
            raise CheckpointError(
                "bad_adapter",
                f"{where}: {served_block} is adapted in {sorted(present)} but not in {missing}, which the"
                " adapter's config targets: SGLang would fail on it at the first request",
            )
