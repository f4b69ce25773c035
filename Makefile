# Two commands: `make run` (local cluster + quick benchmark) and `make test` (whole suite).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
EXTRAS ?= dev,router,bench

.PHONY: run test venv system-deps lint clean

$(VENV)/.installed-$(EXTRAS): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

venv: $(VENV)/.installed-$(EXTRAS)

# redis-server is a real server used by the router tests (Debian package).
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (Debian package)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }

run: venv
	$(VENV)/bin/gcache bench --nodes 3

test: venv system-deps
	$(PY) -m pytest $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check gcache router sglang_adapter tests bench

clean:
	rm -rf $(VENV) build *.egg-info
