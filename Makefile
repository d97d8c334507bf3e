# cgstore — the two commands of the README, and a few helpers.
#   make serve   the store on the embedded default (SQLite + a local directory), no configuration
#   make test    the whole suite against SQLite + directory AND PostgreSQL + S3 (Ceph's RADOS Gateway)
#   make bench   the ratio benchmarks in bench/
#   make docs    regenerate the reference tables in docs/

PYTHON ?= python3
TEST_WORKERS ?= 3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: serve test lint format fuzz soak conformance bench bench-deps chromium ceph docs install install-dev install-worker clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# Installs are stamped so repeated `make` calls don't reinstall; pyproject edits re-trigger them.
$(VENV)/.installed: $(PY) pyproject.toml client/pyproject.toml
	$(PIP) install --quiet -e ./client -e .
	touch $@

# A worker install pins torch (TORCH_VERSION, the dev extra's pin) from PyTorch's CPU index (TORCH_INDEX):
# PyPI's default build is the CUDA one, ~20 nvidia wheels (5.5 GB). Another torch is another
# toolchain (cgstore_client.mint.environment_toolchain): records minted under one miss under the other.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX   ?= https://download.pytorch.org/whl/cpu

# The dev install takes torch==2.13.0 (the dev extra's pin) from the machine's own package
# configuration: CI and the test suite never reach PyTorch's index.
$(VENV)/.installed-dev: $(PY) pyproject.toml client/pyproject.toml
	$(PIP) install --quiet -e './client[torch]' -e '.[dev]'
	touch $@ $(VENV)/.installed

# The worker side of the README's walk-through: the client with its torch extra, on the same pinned CPU torch.
$(VENV)/.installed-worker: $(PY) pyproject.toml client/pyproject.toml
	$(PIP) install --quiet --index-url $(TORCH_INDEX) torch==$(TORCH_VERSION)
	$(PIP) install --quiet -e './client[torch]' -e .
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev
install-worker: $(VENV)/.installed-worker

serve: install
	$(VENV)/bin/cgstore serve

# The test session itself starts PostgreSQL if it is down, creates and drops its own
# database, and starts a single-host Ceph cluster whose RADOS Gateway (S3) listens on a
# free loopback port (tests/support/services.py).
# Three workers (TEST_WORKERS; 0 runs in this process), each a whole test file at a time: a file's
# module fixtures stay in one process, and each worker starts its own services. Files are dealt out
# longest first (tests/conftest.py RUN_FIRST), not xdist's most-tests-first.
# Long fuzz and soak runs are marked and left to their own targets (CI runs `make test`).
test: install-dev chromium ceph lint
	$(PY) -m pytest -m "not fuzz and not soak" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20 --junitxml=.test-results/junit.xml $(PYTEST_ARGS)

# ruff, configured in pyproject.toml: pyflakes, isort, bugbear, pyupgrade, and the formatter's check.
lint: install-dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Rewrites what `make lint` would refuse and can fix by itself.
format: install-dev
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

fuzz: install-dev
	$(PY) -m pytest -m fuzz $(PYTEST_ARGS)

soak: install-dev
	$(PY) -m pytest -m soak $(PYTEST_ARGS)

# The console's browser tests drive Debian's chromium; installed from apt when root and absent.
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "chromium is absent and this is not root: browser tests will fail"; }

# The production configuration's S3 is Ceph's RADOS Gateway (Debian's 16.2, about 61 MB);
# installed from apt when root and absent.
CEPH_TOOLS := ceph-mon ceph-osd radosgw radosgw-admin monmaptool
ceph:
	@for tool in $(CEPH_TOOLS); do command -v $$tool >/dev/null 2>&1 || missing=1; done; \
	  [ -z "$$missing" ] || { [ "$$(id -u)" = 0 ] && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    radosgw ceph-mon ceph-osd ceph-common >/dev/null) \
	  || echo "Ceph is absent and this is not root: the production configuration's tests will fail"; }

# Certify a deployment: CGSTORE_URL=https://… CGSTORE_ADMIN_TOKEN=… make conformance
# (without CGSTORE_URL it runs against the three local deployments, as `make test` does).
conformance: install-dev ceph
	$(PY) -m pytest tests/conformance --junitxml=conformance.xml $(PYTEST_ARGS)

# The reference tables of docs/ (configuration, CLI, routes), rewritten from the code.
docs: install
	$(PY) docs/generate.py

# Tools the network benchmark compares against (Debian packages).
bench-deps:
	@command -v aria2c >/dev/null 2>&1 && command -v curl >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq aria2 curl >/dev/null)

bench: install-dev bench-deps ceph
	@set -e; for script in bench/*.py; do \
	  case $$script in bench/_*) continue;; esac; \
	  echo "== $$script"; $(PY) $$script; done

clean:
	rm -rf $(VENV) .cgstore .test-cache .test-results .pytest_cache .hypothesis conformance.xml
