"""Running the sidecar's heavy work below SGLang's CPU priority.

Preparing a checkpoint (validating it, copying it into the stage, rebuilding a delta there)
runs while SGLang keeps serving rollouts, on the same cores when SGLang runs on the CPU or when
its scheduler needs a core beside the GPU. :func:`lower_this_thread` raises the calling thread's
nice value (Linux keeps one per thread, and threads it starts inherit it) so that the kernel
gives SGLang the cores first and the preparation what is left. Raising a nice value needs no
privilege; the thread cannot lower it again, so it is called on a thread that ends with the work.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

MAX_NICENESS = 19


def lower_this_thread(niceness: int) -> int:
    """Add ``niceness`` (0-19) to this thread's nice value, at most to 19; return the new value
    (or the unchanged one: 0 given, not Linux, or the kernel refused)."""
    tid = threading.get_native_id()
    current = os.getpriority(os.PRIO_PROCESS, tid) if sys.platform == "linux" else 0
    if niceness <= 0 or sys.platform != "linux":
        return current
    wanted = min(MAX_NICENESS, current + niceness)
    try:
        os.setpriority(os.PRIO_PROCESS, tid, wanted)  # on Linux: this thread only
    except OSError as exc:  # a seccomp profile that forbids it: the work runs at normal priority
        log.warning("could not lower the checkpoint preparation's CPU priority (%s); it runs as SGLang does", exc)
        return current
    return wanted
