"""Packages import downward only: rollout_service <- trainer_hooks <- rollout_demo; inside
trainer_hooks, the TRL seam (sglang_generation) sits below the trainer that wires it.

Read from the sources (every import statement, lazy ones inside functions included), so a
layering break fails here even when no test happens to run the importing code path.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ["rollout_service", "trainer_hooks", "rollout_demo"]
"""Bottom first: each package may import only those before it."""


def _imported_packages(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_each_package_imports_only_the_packages_below_it():
    breaks = []
    for index, package in enumerate(LAYERS):
        above = set(LAYERS[index + 1 :])
        files = sorted((REPO / package).rglob("*.py"))
        assert files, f"no sources under {package}/"
        for path in files:
            wrong = _imported_packages(path) & above
            if wrong:
                breaks.append(f"{path.relative_to(REPO)} imports {sorted(wrong)}")
    assert not breaks, "packages import downward only:\n" + "\n".join(breaks)


def _trainer_hooks_imports(path: Path) -> set[str]:
    """The trainer_hooks modules ``path`` imports (relative or absolute, lazy ones included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.update([node.module] if node.module else [alias.name for alias in node.names])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainer_hooks."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("trainer_hooks."))
    return {name.split(".")[0] for name in found}


WIRED_FROM_ABOVE = {"trainer": {"__init__"}, "sglang_generation": {"__init__", "trainer"}}
"""trainer_hooks modules and the only ones that may import them: the trainer wires the seam and
its parts (endpoints, publisher, staleness policy); none of those parts reaches back up."""


def test_the_seam_and_its_parts_do_not_import_the_wiring_above_them():
    breaks = []
    for path in sorted((REPO / "trainer_hooks").glob("*.py")):
        for module in sorted(_trainer_hooks_imports(path) & set(WIRED_FROM_ABOVE)):
            if path.stem not in WIRED_FROM_ABOVE[module]:
                breaks.append(f"trainer_hooks/{path.name} imports trainer_hooks.{module}")
    assert not breaks, "the seam's parts import only downward:\n" + "\n".join(breaks)
    assert "trainer" not in _trainer_hooks_imports(REPO / "trainer_hooks" / "sglang_generation.py")


def test_the_console_command_has_the_demo_and_the_service_cli_does_not():
    from rollout_demo.cli import build_parser as full_parser
    from rollout_service.cli import build_parser as service_parser

    def commands(parser):
        return set(next(a for a in parser._actions if a.dest == "command").choices)

    assert "demo" in commands(full_parser())
    assert commands(full_parser()) - commands(service_parser()) == {"demo"}
