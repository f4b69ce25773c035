# Two commands: `make run` (local cluster + quick benchmark) and `make test` (whole suite).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
EXTRAS ?= dev,router,bench,ucx

.PHONY: run test venv system-deps lint typecheck clean bench-peers sglang-deps package-test image-test

# pyproject.toml holds version ranges; constraints.txt the exact versions tested together.
$(VENV)/.installed-$(EXTRAS): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	touch $@

venv: $(VENV)/.installed-$(EXTRAS)

# redis-server is a real server used by the router tests; systemd-analyze checks deploy/systemd
# (Debian's systemd package; installing it does not start it here); iptables (legacy backend) and
# iproute2 build the fault lab's network namespaces, partitions and packet loss (Debian packages).
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server (Debian package)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }
	@command -v systemd-analyze >/dev/null 2>&1 || { \
	  echo "installing systemd (Debian package, for systemd-analyze)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null; }
	@{ command -v iptables-legacy && command -v ip && command -v tc; } >/dev/null 2>&1 || { \
	  echo "installing iptables and iproute2 (Debian packages, for the fault lab)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables iproute2 >/dev/null; }

run: venv
	$(VENV)/bin/gcache bench throughput --quick --nodes 3

# The peers `gcache bench throughput` measures beside gcache: redis-server (Debian) and Mooncake
# Store (PyPI, non-CUDA wheel; it links libibverbs even when it only speaks TCP).
bench-peers: venv system-deps
	@dpkg -s libibverbs1 >/dev/null 2>&1 || { \
	  echo "installing libibverbs1 (Debian package)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; }
	$(PY) -m pip install -q mooncake-transfer-engine-non-cuda==0.3.13.post1

# The real sglang 0.5.23 (CPU torch, sglang without its CUDA deps) for tests/sglang_adapter;
# idempotent: returns at once when already installed.
sglang-deps: venv
	scripts/install_sglang.sh $(VENV)

# The suite runs in TEST_WORKERS processes (pytest-xdist), a module's tests in one of them: most
# of its time is waiting on the processes the tests start, so 2 workers on 2 cores take about
# half the serial time (3 take less, but timing-bound tests failed beside other load).
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: venv system-deps sglang-deps
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

# Opt-in (minutes, downloads): build the wheel, install it into a clean venv beside sglang 0.5.23's
# own requirement set (CUDA-only packages replaced by the CPU torch), `pip check`; then a venv at
# the lowest versions pyproject.toml allows, running a daemon + master + put/get.
package-test: venv
	GCACHE_PACKAGE_TEST=1 $(PY) -m pytest -q -p no:cacheprovider -s tests/deploy/test_package_install.py $(PYTEST_ARGS)

# Opt-in (minutes, downloads): replay deploy/Containerfile into a debootstrap'd Debian folder
# (chroot + unshare, no container engine) and run gcache daemon + a put/get inside it.
image-test: venv
	@command -v debootstrap >/dev/null 2>&1 || { \
	  echo "installing debootstrap (Debian package)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
	GCACHE_IMAGE_TEST=1 $(PY) -m pytest -q -p no:cacheprovider tests/deploy/test_image.py $(PYTEST_ARGS)

# Lint = ruff + mypy (config in pyproject.toml: strict on gcache.meta, gcache.tier, gcache.client).
lint: venv
	$(VENV)/bin/ruff check gcache router sglang_adapter tests bench
	$(VENV)/bin/mypy

typecheck: venv
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info
