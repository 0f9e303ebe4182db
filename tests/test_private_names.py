"""No module of the package imports another module's private name (``_name``): what a sibling
needs is public, named for what it is (issue 36)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "airflow_provider_pgdecode"


def private_imports() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("airflow_provider_pgdecode"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.relative_to(PACKAGE.parent)}: {alias.name} from {node.module}")
    return found


def test_no_module_imports_a_private_name_of_another() -> None:
    assert private_imports() == []
