"""CPU-only, pure-torch stand-in for SGLang's compiled `sgl_kernel` module.

SGLang 0.5.23 started with `--device cpu` imports a few `*_cpu` helpers from `sgl_kernel` at
import time, but the `sgl-kernel` / `sglang-kernel` wheels on PyPI hold CUDA-only libraries that
fail to import without `libcuda.so.1`. This package supplies exactly the names the CPU path
imports, so that `python -m sglang.launch_server --device cpu` starts and serves on a machine
without a GPU:

- `assign_req_to_token_pool_cpu` is implemented in torch (SGLang calls it to record where a
  request's new tokens live in the KV cache);
- the other names belong to features this project does not use on CPU (speculative decoding,
  KV-cache copies between layers); they exist so the imports succeed and raise
  `NotImplementedError` naming themselves when called.

Importing it also makes the no-argument `torch.get_device_module()` return `torch.cpu` when CUDA
is unavailable: SGLang's `/release_memory_occupation` calls `torch.get_device_module().synchronize()`,
which on a CUDA build of torch without a GPU resolves to `torch.cuda` and kills the scheduler. The
replacement keeps the attributes torch.compile relies on (`__wrapped__`), so SGLang's compiled
functions (e.g. its repetition penalty) still compile and run on the CPU.

It also makes SGLang's LoRA modules create unpinned host tensors (`no_pinned_memory`): with a CUDA
build of torch and no driver, `pin_memory=True` raises and `--enable-lora` dies at start-up.

It is importable as `sgl_kernel` only when its parent folder `rollout_service/_cpu_shims` is on
`PYTHONPATH`, which `rollout_service.sglang_launcher` does only for `--device cpu`. It must never
be put on the path on GPU machines, where the real CUDA `sgl_kernel` is required: importing it
raises ImportError when CUDA is available.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

if torch.cuda.is_available():
    raise ImportError(
        "rollout_service/_cpu_shims/sgl_kernel is the CPU stand-in for SGLang's CUDA kernels, and this"
        " machine has a CUDA device: it must not be imported here. Remove rollout_service/_cpu_shims"
        " from PYTHONPATH (and unset SGLANG_USE_CPU_ENGINE), and install SGLang's own sglang-kernel"
        " (pip install sglang==0.5.23). `rollout-service serve --device cuda` does both for SGLang."
    )

__all__ = [
    "assign_req_to_token_pool_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
]

IS_STAND_IN = True
"""Lets callers tell this stand-in from the real compiled module."""


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write new KV-cache locations into the request-to-token table, in place.

    For each request i, with row r = req_pool_indices[i] and span [start, end) =
    [start_offset[i], end_offset[i]), copy the next (end - start) entries of `out_cache_loc`
    (which holds all requests' new locations back to back, in request order) into
    `req_to_token[r, start:end]`. `pool_len` is the row length of `req_to_token`.
    """
    starts = start_offset.to(device=req_to_token.device, dtype=torch.int64)
    ends = end_offset.to(device=req_to_token.device, dtype=torch.int64)
    lengths = ends - starts
    if bool((lengths < 0).any()):
        raise ValueError(
            f"assign_req_to_token_pool_cpu expected end_offset >= start_offset per request, "
            f"got start={starts.tolist()} end={ends.tolist()}"
        )
    total = int(lengths.sum())
    if total == 0:
        return
    if bool((ends > pool_len).any()):
        raise ValueError(
            f"assign_req_to_token_pool_cpu: end_offset {ends.tolist()} exceeds the pool row length {pool_len}"
        )
    if out_cache_loc.numel() < total:
        raise ValueError(
            f"assign_req_to_token_pool_cpu expected at least {total} entries in out_cache_loc "
            f"(the sum of end - start), found {out_cache_loc.numel()}"
        )
    rows = torch.repeat_interleave(req_pool_indices.to(device=req_to_token.device, dtype=torch.int64), lengths)
    segment_starts = torch.cumsum(lengths, dim=0) - lengths
    position_in_segment = torch.arange(total, device=req_to_token.device) - torch.repeat_interleave(
        segment_starts, lengths
    )
    cols = torch.repeat_interleave(starts, lengths) + position_in_segment
    req_to_token[rows, cols] = out_cache_loc.reshape(-1)[:total].to(req_to_token.dtype)


def _unavailable(name: str, feature: str) -> Callable[..., NoReturn]:
    """A placeholder for a compiled kernel that the CPU stand-in does not provide."""

    def kernel(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by the CPU stand-in "
            f"(rollout_service/_cpu_shims/sgl_kernel); it serves {feature}, which this project "
            "does not support with --device cpu. Disable that feature or run on a GPU with the "
            "real sgl_kernel."
        )

    kernel.__name__ = kernel.__qualname__ = name
    kernel.__doc__ = f"Not available on CPU: raises NotImplementedError ({feature})."
    return kernel


assign_draft_cache_locs_contiguous_cpu = _unavailable("assign_draft_cache_locs_contiguous_cpu", "speculative decoding")
assign_extend_cache_locs_cpu = _unavailable("assign_extend_cache_locs_cpu", "speculative decoding")
build_tree_kernel_efficient_cpu = _unavailable("build_tree_kernel_efficient_cpu", "speculative decoding")
copy_all_layer_kv_cache_cpu = _unavailable(
    "copy_all_layer_kv_cache_cpu", "KV-cache copies between pools (hierarchical caching)"
)
fill_accept_out_cache_loc_cpu = _unavailable("fill_accept_out_cache_loc_cpu", "speculative decoding")
fill_bonus_tokens_cpu = _unavailable("fill_bonus_tokens_cpu", "speculative decoding")
verify_tree_greedy_cpu = _unavailable("verify_tree_greedy_cpu", "speculative decoding")


def _default_device_module_is_cpu_without_cuda() -> None:
    """Make `torch.get_device_module()` (no argument) return `torch.cpu` when CUDA is unavailable.

    Calls with an argument keep torch's behaviour. Applying it twice is harmless.
    """
    original = torch.get_device_module
    if getattr(original, "_sgl_kernel_cpu_stand_in", False) or torch.cuda.is_available():
        return

    def get_device_module(device: Any = None) -> Any:
        if device is None:
            return torch.cpu
        return original(device)

    get_device_module.__doc__ = original.__doc__
    # torch.get_device_module is an lru_cache wrapper, and torch._dynamo registers its tracing
    # handler on `torch.get_device_module.__wrapped__` the first time it compiles anything. Without
    # this attribute every torch.compile in the server raised InternalTorchDynamoError
    # ("'function' object has no attribute '__wrapped__'"), which killed the CPU scheduler on the
    # first request with repetition_penalty != 1 (SGLang compiles apply_scaling_penalties).
    get_device_module.__wrapped__ = getattr(original, "__wrapped__", original)  # type: ignore[attr-defined]
    for name in ("cache_clear", "cache_info"):
        if hasattr(original, name):
            setattr(get_device_module, name, getattr(original, name))
    get_device_module._sgl_kernel_cpu_stand_in = True  # type: ignore[attr-defined]
    torch.get_device_module = get_device_module


_default_device_module_is_cpu_without_cuda()


def _lora_without_pinned_memory() -> None:
    from .no_pinned_memory import install

    install()


_lora_without_pinned_memory()
