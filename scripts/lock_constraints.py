#!/usr/bin/env python
"""Write the constraints files: exact pins of sets verified to install together.

    .venv/bin/python scripts/lock_constraints.py            # every declared Python
    .venv/bin/python scripts/lock_constraints.py --python 3.12

``requirements/constraints-<major.minor>.txt``, one per declared Python: what the provider needs
at run time (``airflow-provider-pgdecode[spark-submit,amazon,openlineage]``: Airflow's own set
included), resolved by pip for that interpreter. This is what a user passes to ``pip install -c``.

``requirements/dev-constraints.txt``: what the checkout's development tools add on the first
declared Python (the ``test``, ``lint``, ``dist`` and ``docs`` extras and their dependencies),
none of the runtime pins repeated, so both files can be given to one ``pip install``.

The pins of the files being replaced are the resolver's starting point (``-c``): a package keeps
its version unless a Python needs another, so a re-lock changes only what it must. Delete a line
to let pip pick that package's newest version. Needs the interpreters (``pyenv``'s by default,
``$PGDECODE_PYTHON_<major><minor>`` to name another) and PyPI or pip's cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "requirements"
PROJECT = "airflow-provider-pgdecode"
PYTHONS = ("3.11", "3.12", "3.13")
"""The Python versions the package declares (setup.cfg's classifiers) and CI installs the wheel on."""
RUNTIME_EXTRAS = "spark-submit,amazon,openlineage"
DEV_EXTRAS = "test,lint,dist,docs"
PYENV_VERSIONS = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"


def constraints_file(python: str) -> Path:
    return REQUIREMENTS / f"constraints-{python}.txt"


DEV_CONSTRAINTS = REQUIREMENTS / "dev-constraints.txt"


def interpreter(python: str) -> Path:
    """The interpreter of ``python`` (``3.12``): ``$PGDECODE_PYTHON_312``, else pyenv's newest patch."""
    configured = os.environ.get(f"PGDECODE_PYTHON_{python.replace('.', '')}")
    if configured:
        return Path(configured)
    found = sorted(
        PYENV_VERSIONS.glob(f"{python}.*/bin/python"),
        key=lambda p: [int(x) for x in re.findall(r"\d+", p.parent.parent.name)],
    )
    if not found:
        raise SystemExit(
            f"no Python {python} under {PYENV_VERSIONS}: install it or set PGDECODE_PYTHON_{python.replace('.', '')}"
        )
    return found[-1]


def read_pins(path: Path) -> dict[str, str]:
    """``{name: version}`` of a constraints file (comments and blank lines skipped)."""
    pins: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            line = line.split("#", 1)[0].strip()
            if "==" in line:
                name, version = line.split("==", 1)
                pins[canonical(name)] = version.strip()
    return pins


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(python: Path, requirement: str, seeds: dict[str, str]) -> dict[str, str]:
    """What ``pip install requirement`` would install for ``python`` into an empty environment."""
    with tempfile.TemporaryDirectory(prefix="pgdecode-lock-") as tmp:
        seed_file = Path(tmp) / "seed.txt"
        seed_file.write_text("".join(f"{n}=={v}\n" for n, v in sorted(seeds.items())), encoding="utf-8")
        report = Path(tmp) / "report.json"
        command = [
            sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run", "--ignore-installed",
            "--quiet", "--report", str(report), "-c", str(seed_file), requirement,
        ]  # fmt: skip
        subprocess.run(command, cwd=ROOT, check=True)
        installs = json.loads(report.read_text(encoding="utf-8"))["install"]
    resolved = {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}
    resolved.pop(PROJECT, None)
    return resolved


def write(path: Path, pins: dict[str, str], header: str) -> None:
    lines = [f"# {line}".rstrip() for line in header.strip().splitlines()]
    path.write_text("\n".join([*lines, *(f"{n}=={v}" for n, v in sorted(pins.items()))]) + "\n", encoding="utf-8")
    print(f"{path.relative_to(ROOT)}: {len(pins)} pins")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--python", action="append", choices=PYTHONS, help="only these (default: all declared)")
    args = parser.parse_args(argv)
    pythons = args.python or list(PYTHONS)
    for python in pythons:
        path = constraints_file(python)
        seeds = read_pins(path) or read_pins(constraints_file(PYTHONS[0]))
        pins = resolve(interpreter(python), f".[{RUNTIME_EXTRAS}]", seeds)
        write(
            path,
            pins,
            f"""
What airflow-provider-pgdecode[{RUNTIME_EXTRAS}] needs at run time on Python {python}, Airflow's own set
included, verified to install together: pip install -c requirements/constraints-{python}.txt ...
Written by scripts/lock_constraints.py; .ci/run installs the wheel with it. Development tools:
requirements/dev-constraints.txt.
""",
        )
    if PYTHONS[0] in pythons:
        runtime = read_pins(constraints_file(PYTHONS[0]))
        dev = resolve(
            interpreter(PYTHONS[0]), f".[{RUNTIME_EXTRAS},{DEV_EXTRAS}]", {**read_pins(DEV_CONSTRAINTS), **runtime}
        )
        changed = sorted(n for n in runtime if n in dev and dev[n] != runtime[n])
        if changed:
            raise SystemExit(f"the development tools need other versions of runtime packages: {changed}")
        write(
            DEV_CONSTRAINTS,
            {n: v for n, v in dev.items() if n not in runtime},
            f"""
The development tools of the checkout (extras {DEV_EXTRAS}) and their dependencies on Python {PYTHONS[0]},
beside requirements/constraints-{PYTHONS[0]}.txt (no runtime pin is repeated here): the Makefile's
pip install -c requirements/constraints-{PYTHONS[0]}.txt -c requirements/dev-constraints.txt.
Written by scripts/lock_constraints.py.
""",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
