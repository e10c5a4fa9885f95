# keyscale: `make run` sets up and runs the demo job, `make test` sets up and runs the suite,
# `make test-fast` the fast lane: the tests and doctests that start no Spark and no server.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.keyscale-installed
# The PySpark the suite runs on (the newest in pyproject.toml's range): pinned here, so that
# what `make test` tested is known, while users' resolvers get the whole range.
PYSPARK := 4.3.0
# The oldest PySpark that pyproject.toml's range admits: `make test-oldest` runs a smoke set on
# it, in a venv of its own (docs/install.md says which versions are tested where).
OLDEST_PYSPARK := 4.0.0
OLDEST := .venv-oldest
# Wheels this Makefile (and the wheel test) download or build, kept between runs: PyPI has
# PySpark only as a ~430 MB sdist, which pip would otherwise build again for every new venv.
WHEELS := .cache/wheels
# The smoke set: Spark's hash agrees with keyscale's key groups, a user's script starts,
# rescales, savepoints and stops a job, a job file runs under spark-submit, and the keyscale
# data source reads state (without pushed filters on PySpark 4.0).
SMOKE := tests/state/test_spark_hash.py \
	tests/api/test_python_api.py::test_a_users_script_starts_rescales_savepoints_and_stops_a_job \
	tests/api/test_python_api.py::test_the_job_file_runs_under_spark_submit_with_the_users_conf \
	tests/state_processor/test_datasource.py::test_the_data_source_on_every_pyspark_of_the_range

.PHONY: setup run test test-fast test-oldest docs lint typecheck bench clean redis browser prometheus

setup: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "make: $(PY) not found (the Makefile's venvs use Python 3.11; PY=python3.12 make ... for another)"; exit 1; }
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,plot]' 'pyspark==$(PYSPARK)'
	@touch $(STAMP)

run: setup
	$(BIN)/python examples/demo.py

# Three test processes on two cores: the tests wait (on a JVM starting, a server, a child
# process) about an eighth of the time, which two processes left idle (12.9 % idle CPU in a
# clean-clone run); a third fills it: 28.3 and 29.2 minutes against 30.4 and 32.1 for two (2026-11-29).
test: setup redis browser prometheus docs
	$(BIN)/python -m pytest -q --durations=25 -n 3 --dist loadfile
	$(MAKE) --no-print-directory test-oldest

# The fast lane, for every change: the pure and in-process tests and src/keyscale's doctests;
# no Spark, no CLI job runs, no servers (tests/conftest.py deselects the tests marked for them
# and fails one that starts Spark or a server anyway). `make test` stays the whole suite.
test-fast: setup
	$(BIN)/python -m pytest -q --fast -n 2 --durations=10

test-oldest: $(OLDEST)/.keyscale-installed
	$(OLDEST)/bin/python -m pytest -q -p no:cacheprovider $(SMOKE)

$(OLDEST)/.keyscale-installed: pyproject.toml $(WHEELS)/pyspark-$(OLDEST_PYSPARK)-py2.py3-none-any.whl
	@test -x $(OLDEST)/bin/python || $(PY) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet --find-links $(WHEELS) -e . 'pyspark==$(OLDEST_PYSPARK)' \
		'pytest>=8' 'pytest-timeout>=2.3' 'hypothesis>=6.100'
	@touch $@

# PySpark's wheel, built once from its sdist (pip's own cache is not this Makefile's to rely on).
$(WHEELS)/pyspark-%-py2.py3-none-any.whl:
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir $(WHEELS) 'pyspark==$*'

# The docs site, into site/: strict, so a broken link or anchor, a page left out of the nav,
# or a docstring the API reference cannot render fails the build (and so `make test`).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# The log tests start their own redis-server; install the Debian package if it is missing (as root).
redis:
	@command -v redis-server >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; } \
		|| { echo "make: could not install redis-server (apt-get, as root)"; exit 1; }

# The dashboard tests drive Debian's chromium through chromedriver; install them if missing (as root).
browser:
	@{ command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; } || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
		|| { echo "make: could not install chromium and chromium-driver (apt-get, as root)"; exit 1; }

# The Prometheus scrape test starts its own Debian prometheus (own config, data folder, port); install it if missing (as root).
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } \
		|| { echo "make: could not install prometheus (apt-get, as root)"; exit 1; }

lint: setup
	$(BIN)/ruff check src tests bench examples tools
	$(BIN)/mypy

clean:
	rm -rf $(VENV) $(OLDEST) .cache .pytest_cache .mypy_cache build site
