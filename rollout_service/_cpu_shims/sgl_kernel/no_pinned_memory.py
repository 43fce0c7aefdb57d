"""CPU-only: make SGLang's LoRA modules create ordinary (unpinned) host tensors.

SGLang 0.5.23's LoRA code (``sglang/srt/lora/layers.py``, ``lora/backend/torch_backend.py``)
creates host tensors with ``pin_memory=True`` and calls ``Tensor.pin_memory()``. Pinned (page-locked)
memory only speeds up copies to a GPU; on a CUDA build of torch without a driver, asking for it
raises ``RuntimeError: Found no NVIDIA driver on your system`` and the LoRA server dies at start-up.

`install()` (called when the stand-in is imported, i.e. only on a CPU-only machine) does two things,
both only while ``torch.cuda.is_available()`` is False:

- every module under ``sglang.srt.lora`` is given, as its ``torch`` global, a view of torch whose
  tensor factories drop the ``pin_memory`` argument (an import hook; other modules keep torch);
- ``torch.Tensor.pin_memory()`` returns the tensor itself (with no GPU there is nothing to pin for).

Nothing else changes: the tensors hold the same values, on the same (CPU) device.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

LORA_PACKAGE = "sglang.srt.lora"
FACTORIES = (
    "tensor",
    "empty",
    "zeros",
    "ones",
    "full",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "arange",
    "as_tensor",
    "empty_strided",
)


def _without_pin(factory: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return factory(*args, **kwargs)

    call.__name__ = call.__qualname__ = factory.__name__
    call.__doc__ = factory.__doc__
    return call


class _TorchWithoutPinnedMemory(types.ModuleType):
    """``torch`` as SGLang's LoRA modules see it on the CPU: factories ignore ``pin_memory``."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in FACTORIES:
            setattr(self, name, _without_pin(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


_TORCH_VIEW: _TorchWithoutPinnedMemory | None = None


class _LoraModuleFinder(importlib.abc.MetaPathFinder):
    """Gives each ``sglang.srt.lora`` module the unpinned torch view right after it executes."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not (fullname == LORA_PACKAGE or fullname.startswith(LORA_PACKAGE + ".")):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            # Before execution too: module-level code (e.g. a constant buffer) may pin already.
            module.__dict__["torch"] = _TORCH_VIEW
            original_exec(module)
            if module.__dict__.get("torch") is torch:
                module.__dict__["torch"] = _TORCH_VIEW

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _tensor_pin_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """No GPU to pin for: the tensor itself (a CUDA build of torch would raise without a driver)."""
    return self


def install() -> bool:
    """Apply both changes when CUDA is unavailable; True when applied (idempotent)."""
    global _TORCH_VIEW
    if torch.cuda.is_available():
        return False
    if _TORCH_VIEW is None:
        _TORCH_VIEW = _TorchWithoutPinnedMemory()
    if not any(isinstance(f, _LoraModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _LoraModuleFinder())
    for name, module in list(sys.modules.items()):  # LoRA modules imported before the stand-in
        if (
            module is not None
            and (name == LORA_PACKAGE or name.startswith(LORA_PACKAGE + "."))
            and module.__dict__.get("torch") is torch
        ):
            module.__dict__["torch"] = _TORCH_VIEW
    torch.Tensor.pin_memory = _tensor_pin_memory
    return True
