"""Task arguments as Airflow hands them over: a value, or the rendered template of one."""

from __future__ import annotations

import json
from collections.abc import Sequence


def parse_batch_paths(value: str | Sequence[str] | None) -> list[str]:
    """Batch directories from a path, a list of paths, or a rendered template of either (a JSON list)."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                parsed = json.loads(text)
            except ValueError:
                import ast

                parsed = ast.literal_eval(text)
            return [str(p) for p in parsed if p]
        return [text] if text else []
    return [str(p) for p in value if p]
