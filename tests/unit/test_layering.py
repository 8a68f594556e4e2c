"""The import rules the package docstrings state, checked on the source with `ast`:

- seamlessflow/ imports no service module, except seamlessflow/planner/, which runs the
  scheduler's SIMULATED cluster in-process (seamlessflow/__init__.py, seamlessflow/planner/);
- a service imports only itself and `shared`, never another service (shared/__init__.py).

Every import counts, at module level or inside a function.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) for every absolute import in a file (`from services import x`
    gives services.x: the name is a package)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "services":
            out += [(node.lineno, f"services.{a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def violations(root: Path) -> list[str]:
    bad = []
    for path in sorted((root / "seamlessflow").rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[1] == "planner":
            continue
        bad += [f"{rel}:{line} imports {mod}" for line, mod in imported(path)
                if mod == "services" or mod.startswith("services.")]
    for path in sorted((root / "services").rglob("*.py")):
        rel = path.relative_to(root)
        if len(rel.parts) < 3:  # services/__init__.py
            continue
        own = f"services.{rel.parts[1]}"
        bad += [f"{rel}:{line} imports {mod}" for line, mod in imported(path)
                if mod.startswith("services.") and mod != own and not mod.startswith(own + ".")]
    return bad


def test_seamlessflow_imports_no_service_and_services_import_no_other_service():
    assert violations(ROOT) == []


def test_a_forbidden_import_is_caught(tmp_path):
    for rel, src in {
        "seamlessflow/ops/x.py": "def f():\n    from services.scheduler.registry import Registry\n",
        "seamlessflow/planner/ok.py": "from services.scheduler.sim import simulate\n",
        "services/gateway/x.py": "from services import trajectory\nimport services.gateway.app\n",
        "services/rollout/ok.py": "from services.rollout import engine\nfrom shared import bus\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    assert violations(tmp_path) == ["seamlessflow/ops/x.py:2 imports services.scheduler.registry",
                                    "services/gateway/x.py:1 imports services.trajectory"]
