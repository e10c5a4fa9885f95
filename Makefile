# keyscale: `make run` sets up and runs the demo job, `make test` sets up and runs the suite.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.keyscale-installed

.PHONY: setup run test docs lint typecheck bench clean redis browser prometheus

setup: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "make: $(PY) not found (keyscale needs Python 3.11)"; exit 1; }
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,plot]'
	@touch $(STAMP)

run: setup
	$(BIN)/python examples/demo.py

test: setup redis browser prometheus docs
	$(BIN)/python -m pytest -q --durations=25 -n 2 --dist loadfile

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
	rm -rf $(VENV) .pytest_cache .mypy_cache build site
