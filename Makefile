# Two commands set everything up: `make run` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
WORKERS ?= 1

.PHONY: run test bench serve migrate plugins sysdeps clean

$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The old quickjs binding shares quickjs-ng's package dir and its .so wins: remove both first.
	! $(PY) -m pip show -q quickjs >/dev/null 2>&1 || $(PY) -m pip uninstall -y -q quickjs quickjs-ng
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

# System packages the tests need: Debian's chromium for the dashboard's browser test.
sysdeps:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the browser tests"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "WARNING: could not install chromium (the browser test will fail)"; }

migrate: $(VENV)/.installed
	$(PY) manage.py migrate --noinput

plugins: migrate
	$(PY) manage.py loadplugins

# Embedded default: one process, SQLite, in-memory channel layer. REDIS_URL / DATABASE_URL
# switch to Redis and PostgreSQL; WORKERS=N runs N ASGI worker processes (see docs/operations.md).
run: plugins serve

# execapp.serve = uvicorn + a drain before every shutdown (SIGTERM/Ctrl+C): accepted events get
# their `done` before connections close. WORKERS=N: N processes, one ExecPool each.
serve: $(VENV)/.installed
	$(PY) -m execapp.serve --host $(HOST) --port $(PORT) --workers $(WORKERS)

test: $(VENV)/.installed sysdeps
	$(PY) -m pytest

bench: $(VENV)/.installed
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) db.sqlite3 staticfiles
