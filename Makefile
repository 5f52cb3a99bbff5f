# Set-up and checks. `make demo` and `make test` start from a fresh machine (Python 3.11).
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VPY) -m pip
STAMP := $(VENV)/.deps-stamp
NVCC ?= nvcc

.PHONY: venv install build demo test cuda-check bench clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first, pinned to the CPU build on disk, so pip never pulls a CUDA build.
$(STAMP): $(VPY) setup.py
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q numpy "pyyaml>=6" "safetensors>=0.4" "einops>=0.7" "tqdm>=4.60" ninja \
	    pytest pytest-timeout scikit-learn mlxtend matplotlib \
	    "transformers==5.23.0" "compressed-tensors==0.20.0"
	touch $(STAMP)

venv: $(STAMP)

# Editable install; builds the csrc/ CPU extension in place when a compiler is present.
build: $(STAMP)
	$(PIP) install -q --no-build-isolation --no-deps -e .

fashion-mnist:
	@test -d /usr/share/datasets/fashion-mnist || (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) \
	    || echo "could not install Debian dataset-fashion-mnist; the demo needs it"

demo: build fashion-mnist
	$(VPY) -m model_zoo.demo_fashion_mnist

test: build fashion-mnist cuda-check
	$(VPY) -m pytest -q -rs --timeout=900 tests

# Compile every .cu for sm_80 and sm_90; any error or warning fails.
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

bench: build
	$(VPY) benchmarks/kernels.py

clean:
	rm -rf build *.egg-info qcompress/*.so
