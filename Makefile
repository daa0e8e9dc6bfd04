# Two commands set everything up: `make run` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
WORKERS ?= 1

.PHONY: run welcome test lint bench serve migrate plugins sysdeps benchdeps clean

$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The old quickjs binding shares quickjs-ng's package dir and its .so wins: remove both first.
	! $(PY) -m pip show -q quickjs >/dev/null 2>&1 || $(PY) -m pip uninstall -y -q quickjs quickjs-ng
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

# System packages the tests need: Debian's chromium for the dashboard's browser test, Debian's
# prometheus for promtool (checks docs/prometheus/ rules; the package's daemon is not started).
sysdeps:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the browser tests"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "WARNING: could not install chromium (the browser test will fail)"; }
	@command -v promtool >/dev/null 2>&1 || { \
	  echo "installing Debian's prometheus for promtool (the rules test)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    prometheus >/dev/null) || echo "WARNING: could not install prometheus (the promtool test will fail)"; }

migrate: $(VENV)/.installed
	$(PY) manage.py migrate --noinput

plugins: migrate
	$(PY) manage.py loadplugins

# Embedded default: one process, SQLite, in-memory channel layer. REDIS_URL / DATABASE_URL
# switch to Redis and PostgreSQL; WORKERS=N runs N ASGI worker processes (see docs/operations.md).
run: plugins welcome serve

# Where to go next, printed before the server's own log lines.
welcome:
	@echo ""
	@echo "execapp serves on http://$(HOST):$(PORT)/  (Ctrl+C drains and stops it)"
	@echo "  admin:           http://$(HOST):$(PORT)/admin/  (Events, Live pool dashboard, Plugins)"
	@echo "  1. an admin user: $(PY) manage.py createsuperuser"
	@echo "  2. a client token: $(PY) manage.py create_token me   (then: $(PY) -m websockets \"ws://$(HOST):$(PORT)/ws/events/?token=<token>\")"
	@echo ""

# execapp.serve = uvicorn + a drain before every shutdown (SIGTERM/Ctrl+C): accepted events get
# their `done` before connections close. WORKERS=N: N processes, one ExecPool each.
serve: $(VENV)/.installed
	$(PY) -m execapp.serve --host $(HOST) --port $(PORT) --workers $(WORKERS)

# TEST_WORKERS pytest-xdist processes (each with its own run id: its own PostgreSQL database and
# Redis key prefix, see tests/conftest.py). Many tests wait on servers they start, so two
# processes keep the 2-core CI machine busy. loadgroup: the sandbox-budget tests (tests/plugins)
# run one after another in one process (tests/conftest.py, SANDBOX_TESTS).
TEST_WORKERS ?= 2
test: $(VENV)/.installed sysdeps
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup

# Static checks, configured in pyproject.toml: ruff on the repository's Python, mypy on the app
# (execapp, plugins, config). .ci/run runs this before `make test`.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(PY) -m mypy

bench: $(VENV)/.installed benchdeps
	$(PY) bench/run.py

# Debian's valgrind for the instruction counts of bench/callgrind_hot_path.py (without it the
# engine bench leaves those rows out; the timed rows do not need it).
benchdeps:
	@command -v valgrind >/dev/null 2>&1 || { \
	  echo "installing Debian's valgrind for the instruction-count rows"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    valgrind >/dev/null) || echo "WARNING: could not install valgrind (no instruction-count rows)"; }

clean:
	rm -rf $(VENV) db.sqlite3 staticfiles
