# flashgen: see README.md. Every target runs on a machine without a GPU except test-gpu and bench.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
FLASHGEN ?= $(PYTHON) -m flashgen.cli
JOBS ?=
JOBS_FLAG := $(if $(JOBS),-j $(JOBS),)
TORCH_VERSION ?= 2.13.0

.DEFAULT_GOAL := build
.PHONY: install build build-all wheel test test-gpu bench tune clean

## install: torch (pinned, installed first so pip never pulls a multi-GB CUDA build), the package
## in editable mode with its torch and dev extras, then the default kernel variants
install:
	$(PIP) install "torch==$(TORCH_VERSION)"
	$(PIP) install -e '.[torch,dev]'
	$(MAKE) build

## build: the default variant set (configs with default_build: true, plus the tiles configs/tune/*.yaml
## name) -> build/manifest.json
build:
	$(FLASHGEN) build $(JOBS_FLAG)

## build-all: every variant in configs/, then the wheel in dist/ with all of them
build-all:
	$(FLASHGEN) build --all $(JOBS_FLAG)
	$(MAKE) wheel FLASHGEN_VARIANTS=all

## wheel: dist/flashgen-*.whl with its kernels. The build backend (setup.py) compiles the set
## $(FLASHGEN_VARIANTS) (default | all | name globs) through the build cache, so after `make build`
## nothing is compiled again; a failed variant fails the wheel.
FLASHGEN_VARIANTS ?= default
wheel:
	rm -rf .whl/setuptools dist/flashgen-*.whl
	FLASHGEN_VARIANTS=$(FLASHGEN_VARIANTS) $(PIP) wheel --no-deps --no-build-isolation -w dist .
	@ls -l dist/flashgen-*.whl

## test: CPU tests (real nvcc compiles included); GPU tests are deselected
test:
	$(PYTHON) -m pytest -m "not gpu" tests

## test-gpu: the GPU tests (tests/gpu; they skip without a Hopper GPU)
test-gpu:
	$(PYTHON) -m pytest -m gpu tests

## bench: the FA3-protocol benchmark, forward and backward (needs a GPU); options: make bench BENCH_ARGS="..."
BENCH_ARGS ?= --backward
bench:
	$(PYTHON) -m flashgen.cli bench $(BENCH_ARGS)

## tune: build the default set + the tile candidates, time them on this GPU, write configs/tune/<gpu-slug>.yaml
## (needs a GPU; options: make tune TUNE_ARGS="--dtypes bf16 --seqlens 1024,4096")
TUNE_ARGS ?=
tune:
	$(FLASHGEN) tune --build $(JOBS_FLAG) $(TUNE_ARGS)

clean:
	rm -rf build dist .whl *.egg-info .pytest_cache
