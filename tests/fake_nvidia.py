"""A fake `nvidia-smi` on PATH, for CPU tests of what the launcher and the GPU example do on GPUs.

It answers the queries the project makes (`-L`, `--query-gpu=...`, `--query-compute-apps=...`)
from a JSON description written next to it, so a test decides how many GPUs there are, which
driver they run and which processes hold memory on them.
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path
from typing import Any

SCRIPT = r"""#!__PYTHON__
import json, sys
spec = json.load(open(__SPEC__))
args = sys.argv[1:]
gpus = spec["gpus"]
if args[:1] == ["-L"]:
    for g in gpus:
        print(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})")
    sys.exit(0)
query = next((a for a in args if a.startswith("--query-")), "")
fields = query.split("=", 1)[1].split(",") if "=" in query else []
if query.startswith("--query-gpu="):
    for g in gpus:
        print(", ".join(str(g[f.replace(".", "_")]) for f in fields))
elif query.startswith("--query-compute-apps="):
    for app in spec.get("apps", []):
        print(", ".join(str(app[f]) for f in fields))
else:
    print("fake nvidia-smi: unsupported arguments", args, file=sys.stderr)
    sys.exit(9)
"""


def install_fake_nvidia_smi(
    bin_dir: Path, gpus: list[dict[str, Any]], apps: list[dict[str, Any]] = (), driver: str = "570.86.15"
) -> Path:
    """Write `bin_dir/nvidia-smi`; put `bin_dir` first on PATH to use it."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    spec = bin_dir / "nvidia-smi.json"
    full = []
    for i, g in enumerate(gpus):
        full.append(
            {
                "index": i,
                "name": "NVIDIA H200",
                "uuid": f"GPU-{i:08d}-fake",
                "memory_total": 143771,
                "memory_used": 0,
                "driver_version": driver,
                **g,
            }
        )
    spec.write_text(json.dumps({"gpus": full, "apps": list(apps)}))
    script = bin_dir / "nvidia-smi"
    script.write_text(SCRIPT.replace("__PYTHON__", sys.executable).replace("__SPEC__", repr(str(spec))))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script
