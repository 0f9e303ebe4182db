"""Build hook for the optional C fast path of the extract (``capture/_native.c``).

Everything else is declared in setup.cfg. The extension is optional: without a C compiler
the install still succeeds and the extract uses its pure-Python path.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "airflow_provider_pgdecode.capture._native",
            sources=["airflow_provider_pgdecode/capture/_native.c"],
            extra_compile_args=["-O2", "-std=c99", "-Wall", "-Wno-missing-braces"],
            optional=True,
        )
    ]
)
