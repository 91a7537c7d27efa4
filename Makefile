# kvtier — everything a fresh machine needs is installed from here.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,plot,redis,mooncake,metrics
STAMP := $(VENV)/.kvtier-installed

.PHONY: venv test test-fast serve demo bench lint typecheck clean sysdeps builddeps

$(STAMP): pyproject.toml setup.py kernels/_fileio.c kernels/_xxh3_avx2.c
	@$(MAKE) --no-print-directory builddeps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

venv: $(STAMP)

# What the C extension kvtier.kernels._fileio (the file L3 backend's batch I/O) builds with:
# a C compiler and the xxHash header. Without them kvtier still installs and runs, slower.
builddeps:
	@if ! command -v cc >/dev/null 2>&1 || [ ! -f /usr/include/xxhash.h ]; then \
		if command -v apt-get >/dev/null 2>&1; then \
			SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
			$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
				--no-install-recommends gcc libc6-dev libxxhash-dev >/dev/null; \
		else echo "builddeps: apt-get not found; install a C compiler and xxhash.h by hand"; fi; \
	fi

# Debian packages the integration tests use (Redis server, libibverbs for Mooncake,
# systemd-analyze to verify the unit).
sysdeps:
	@if ! command -v redis-server >/dev/null 2>&1 || ! ldconfig -p | grep -q libibverbs.so.1 \
			|| ! command -v systemd-analyze >/dev/null 2>&1; then \
		if command -v apt-get >/dev/null 2>&1; then \
			SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
			$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
				--no-install-recommends redis-server libibverbs1 systemd >/dev/null; \
		else echo "sysdeps: apt-get not found; install redis-server, libibverbs1, systemd by hand"; fi; \
	fi

test: venv sysdeps
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -q -p no:cacheprovider tests/unit $(PYTEST_ARGS)

serve: venv
	$(VENV)/bin/kvtierd $(ARGS)

demo: venv
	$(VENV)/bin/kvtier demo $(ARGS)

bench: venv sysdeps
	$(VENV)/bin/kvtier bench l2 --json bench/results/l2.json
	$(VENV)/bin/kvtier bench e2e --json bench/results/e2e.json
	$(VENV)/bin/kvtier bench l3 --backend file --json bench/results/l3_file.json
	$(VENV)/bin/kvtier bench l3 --backend redis --json bench/results/l3_redis.json
	$(VENV)/bin/kvtier bench l3 --backend mooncake --json bench/results/l3_mooncake.json
	$(VENV)/bin/kvtier bench restart --json bench/results/restart.json

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

typecheck: venv
	$(VENV)/bin/mypy config ipc daemon client kernels

clean:
	rm -rf $(VENV) build *.egg-info kernels/*.so
