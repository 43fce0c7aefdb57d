"""CPU-only start-up fix for SGLang 0.5.23, run by every Python process of a CPU SGLang server.

Python imports ``sitecustomize`` at start-up from the first ``sys.path`` entry that holds one.
This folder (``rollout_service/_cpu_shims``) is on ``PYTHONPATH`` only for SGLang on the CPU
(``SGLangServer`` with ``--device cpu`` and the CPU rollout image; on CUDA the launcher strips it),
so nothing here runs on a GPU machine. What it does:

* **Repetition penalty without torch.compile.** SGLang compiles
  ``sglang.srt.sampling.penaltylib.repetition_penalty.apply_scaling_penalties`` with
  ``torch.compile`` at import. In the CPU scheduler the first call raises
  ``InternalTorchDynamoError`` and kills the server, so any request with ``repetition_penalty != 1``
  crashes it. An import hook replaces that one function by its uncompiled original (the same
  ``torch.where`` on the logits) as soon as its module has run, before other modules import the
  name. Everything else keeps torch's and SGLang's behaviour (no global ``TORCHDYNAMO_DISABLE``).
  The hook also checks ``torch.cuda.is_available()`` and does nothing on a GPU.
  ``ROLLOUT_SHIM_KEEP_COMPILED_PENALTIES=1`` keeps the compiled function (to reproduce the crash).

Then it runs the ``sitecustomize`` that this one shadows, if the interpreter has one.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Sequence

PENALTY_MODULE = "sglang.srt.sampling.penaltylib.repetition_penalty"
EAGER_FUNCTIONS = ("apply_scaling_penalties",)
KEEP_COMPILED_ENV = "ROLLOUT_SHIM_KEEP_COMPILED_PENALTIES"


def make_eager(module: ModuleType) -> list[str]:
    """Replace the ``torch.compile`` wrappers of ``EAGER_FUNCTIONS`` in ``module`` by their originals.

    Returns the names replaced. Nothing is replaced when CUDA is available.
    """
    torch = sys.modules.get("torch")
    if torch is None or torch.cuda.is_available():
        return []
    replaced = []
    for name in EAGER_FUNCTIONS:
        original = getattr(getattr(module, name, None), "_torchdynamo_orig_callable", None)
        if original is not None:
            setattr(module, name, original)
            replaced.append(name)
    return replaced


class _EagerPenaltiesFinder(importlib.abc.MetaPathFinder):
    """Finds the penalty module as usual and patches it right after it has executed."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None):
        if fullname != PENALTY_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            make_eager(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's own loader
        return spec


def install() -> bool:
    """Install the import hook (once); False when disabled by ``KEEP_COMPILED_ENV``."""
    if os.environ.get(KEEP_COMPILED_ENV, "").strip() in ("1", "true", "yes"):
        return False
    if not any(isinstance(f, _EagerPenaltiesFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _EagerPenaltiesFinder())
    already = sys.modules.get(PENALTY_MODULE)
    if already is not None:
        make_eager(already)
    return True


def _run_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None or spec.origin == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


install()
_run_shadowed_sitecustomize()
