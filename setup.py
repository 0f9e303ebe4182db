"""Build hook for the optional C fast path of the extract (``capture/csrc/``, built as ``capture._native``).

Everything else is declared in setup.cfg. ``PGDECODE_BUILD_NATIVE`` chooses the build:

- unset or ``auto``: the extension is built when a C compiler is there; without one the install
  still succeeds (a wheel without ``_native``) and the extract uses its pure-Python path.
- ``1`` (``true``, ``yes``, ``on``): the extension must build, or the build fails. The manylinux
  wheels are built this way (cibuildwheel's environment in pyproject.toml, scripts/check_dist.py).
- ``0`` (``false``, ``no``, ``off``): no extension: a pure-Python ``py3-none-any`` wheel, the
  fallback for platforms without a binary wheel.
"""

import os

from setuptools import Extension, setup

CSRC = "airflow_provider_pgdecode/capture/csrc"
BUILD_NATIVE_ENV = "PGDECODE_BUILD_NATIVE"


def build_native() -> bool | None:
    """True: the extension is required; None: built if possible; False: not built."""
    value = os.environ.get(BUILD_NATIVE_ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise SystemExit(
        f"{BUILD_NATIVE_ENV}={os.environ[BUILD_NATIVE_ENV]!r} is not understood: use 1 (the C extension must "
        "build), 0 (a pure-Python wheel without it) or auto (built when a C compiler is available; the default)"
    )


def ext_modules() -> list[Extension]:
    native = build_native()
    if native is False:
        return []
    return [
        Extension(
            "airflow_provider_pgdecode.capture._native",
            sources=[
                f"{CSRC}/module.c",
                f"{CSRC}/copy_reader.c",
                f"{CSRC}/test_decoding.c",
                f"{CSRC}/pgoutput.c",
                f"{CSRC}/parts.c",
                f"{CSRC}/buffers.c",
            ],
            include_dirs=[CSRC],
            depends=[f"{CSRC}/native.h"],
            extra_compile_args=["-O2", "-std=c99", "-Wall", "-Wno-missing-braces"],
            optional=native is None,
        )
    ]


# setuptools runs this file as __main__ (pip, build, setup.py build_ext); tests import it for ext_modules().
if __name__ == "__main__":
    setup(ext_modules=ext_modules())
