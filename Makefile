# flashgen: see README.md. Every target runs on a machine without a GPU except test-gpu and bench.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
FLASHGEN ?= $(PYTHON) -m flashgen.cli
JOBS ?=
JOBS_FLAG := $(if $(JOBS),-j $(JOBS),)
TORCH_VERSION ?= 2.13.0
KERNELS := runtime/_kernels

.DEFAULT_GOAL := build
.PHONY: install build build-all wheel test test-gpu bench clean

## install: torch (pinned, installed first so pip never pulls a multi-GB CUDA build), the package
## in editable mode with its torch and dev extras, then the default kernel variants
install:
	$(PIP) install "torch==$(TORCH_VERSION)"
	$(PIP) install -e '.[torch,dev]'
	$(MAKE) build

## build: the default variant set (configs with default_build: true) -> build/manifest.json
build:
	$(FLASHGEN) build $(JOBS_FLAG)

## build-all: every variant in configs/, then the wheel in dist/
build-all:
	$(FLASHGEN) build --all $(JOBS_FLAG)
	$(MAKE) wheel

## wheel: pack build/manifest.json + build/fatbin/*.fatbin + the Python packages into dist/
wheel:
	@test -f build/manifest.json || { echo "no build/manifest.json: run 'make build' or 'make build-all' first"; exit 1; }
	rm -rf $(KERNELS) .whl/setuptools dist/flashgen-*.whl
	mkdir -p $(KERNELS)/fatbin
	cp build/manifest.json $(KERNELS)/manifest.json
	cp build/fatbin/*.fatbin $(KERNELS)/fatbin/
	$(PIP) wheel --no-deps -w dist .
	rm -rf $(KERNELS)
	@ls -l dist/flashgen-*.whl

## test: CPU tests (real nvcc compiles included); GPU tests are deselected
test:
	$(PYTHON) -m pytest -m "not gpu" tests

## test-gpu: the GPU tests (tests/gpu; they skip without a Hopper GPU)
test-gpu:
	$(PYTHON) -m pytest -m gpu tests

## bench: the FA3-protocol benchmark (needs a GPU); options: make bench BENCH_ARGS="..."
bench:
	$(PYTHON) -m flashgen.cli bench $(BENCH_ARGS)

clean:
	rm -rf build dist .whl $(KERNELS) *.egg-info .pytest_cache
