"""Build hook for the optional C fast path of the extract (``capture/csrc/``, built as ``capture._native``).

Everything else is declared in setup.cfg. The extension is optional: without a C compiler
the install still succeeds and the extract uses its pure-Python path.
"""

from setuptools import Extension, setup

CSRC = "airflow_provider_pgdecode/capture/csrc"

setup(
    ext_modules=[
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
            optional=True,
        )
    ]
)
