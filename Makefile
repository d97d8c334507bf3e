# cgstore — the two commands of the README, and a few helpers.
#   make serve   the store on the embedded default (SQLite + a local directory), no configuration
#   make test    the whole suite against SQLite + directory AND PostgreSQL + S3 (moto_server)
#   make bench   the ratio benchmarks in bench/

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: serve test conformance bench install install-dev clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Installs are stamped so repeated `make` calls don't reinstall; pyproject edits re-trigger them.
$(VENV)/.installed: $(PY) pyproject.toml client/pyproject.toml
	$(PIP) install --quiet -e ./client -e .
	touch $@

# torch==2.13.0 is pinned by the dev extra: the CPU build on this machine's disk.
$(VENV)/.installed-dev: $(PY) pyproject.toml client/pyproject.toml
	$(PIP) install --quiet -e './client[torch]' -e '.[dev]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

serve: install
	$(VENV)/bin/cgstore serve

# The test session itself starts PostgreSQL if it is down, creates and drops its own
# database, and runs moto_server on a free loopback port (tests/support/services.py).
test: install-dev
	$(PY) -m pytest --junitxml=.test-results/junit.xml $(PYTEST_ARGS)

# Certify a deployment: CGSTORE_URL=https://… CGSTORE_ADMIN_TOKEN=… make conformance
# (without CGSTORE_URL it runs against the three local deployments, as `make test` does).
conformance: install-dev
	$(PY) -m pytest tests/conformance --junitxml=conformance.xml $(PYTEST_ARGS)

bench: install-dev
	@set -e; for script in bench/*.py; do \
	  case $$script in bench/_*) continue;; esac; \
	  echo "== $$script"; $(PY) $$script; done

clean:
	rm -rf $(VENV) .cgstore .test-cache .test-results .pytest_cache .hypothesis conformance.xml
