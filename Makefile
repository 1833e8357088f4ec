# Every target installs what it needs on first use; re-runs reuse .venv and the cached Horovod wheel.
PY        := .venv/bin/python
PIP       := $(PY) -m pip
STAMP     := .venv/.hvdcomp-stamps
CONSTRAIN := requirements/constraints.txt
PYTEST_ARGS ?=
# make image [IMAGE_FLAVOUR=gpu] [DOCKER_BUILD_ARGS="--build-arg CUDA_CC_LIST=80,90"]
IMAGE          ?= hvdcomp
IMAGE_FLAVOUR  ?= cpu
GPU_BASE_IMAGE ?= nvidia/cuda:13.0.2-devel-ubuntu24.04
DOCKER_BUILD_ARGS ?=

.PHONY: all install system-deps horovod test test-fast lint sanitize demo clean-venv image image-test

all: install

system-deps:
	@if ! command -v mpicxx >/dev/null || ! command -v mpirun >/dev/null || ! command -v cmake >/dev/null; then \
	  echo "installing Debian packages: libopenmpi-dev openmpi-bin cmake g++ make"; \
	  if [ "$$(id -u)" != 0 ]; then echo "error: need root (or install them yourself)" >&2; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    libopenmpi-dev openmpi-bin cmake g++ make >/dev/null; \
	fi

$(STAMP)/torch: $(CONSTRAIN)
	@test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c $(CONSTRAIN) torch torchvision \
	  setuptools wheel packaging numpy cloudpickle psutil pyyaml cffi
	@mkdir -p $(STAMP) && touch $@

horovod: system-deps $(STAMP)/torch
	PYTHON=$(PY) scripts/install_horovod.sh

$(STAMP)/package: setup.py $(CONSTRAIN) | $(STAMP)/torch
	$(MAKE) horovod
	$(PIP) install -q -c $(CONSTRAIN) --no-build-isolation -e ".[horovod,mpi,examples,dev,lightning]"
	@touch $@

install: system-deps horovod $(STAMP)/package

test: install
	.venv/bin/ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: install
	.venv/bin/ruff check .

# The native kernels' tests (and the two-stage and rotation tests that run them) against an AddressSanitizer +
# UndefinedBehaviorSanitizer build of them (its own cache entry); libasan (and libstdc++, whose exceptions it
# intercepts) are preloaded: the interpreter is not built with it.
SANITIZE_TESTS ?= tests/test_native.py tests/test_native_bounds.py tests/test_two_stage.py tests/test_rotation.py
sanitize: install
	HVDCOMP_NATIVE_SANITIZE=1 ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  LD_PRELOAD="$$($${CXX:-g++} -print-file-name=libasan.so) $$($${CXX:-g++} -print-file-name=libstdc++.so)" \
	  $(PY) -m pytest -p no:cacheprovider $(SANITIZE_TESTS) $(PYTEST_ARGS)

demo: install
	$(PY) examples/demo.py

clean-venv:
	rm -rf .venv

image:
ifeq ($(IMAGE_FLAVOUR),gpu)
	docker build -f docker/Dockerfile -t $(IMAGE):gpu --build-arg BASE_IMAGE=$(GPU_BASE_IMAGE) \
	  --build-arg HOROVOD_FLAVOUR=gpu $(DOCKER_BUILD_ARGS) .
else
	docker build -f docker/Dockerfile -t $(IMAGE):cpu $(DOCKER_BUILD_ARGS) .
endif

# Builds the CPU image with a dockerd of its own and smoke-tests it (scripts/image_test.sh). Exit 77
# from the script means dockerd cannot start here; IMAGE_TEST_ALLOW_SKIP=1 (CI) turns that into a skip.
image-test:
	@scripts/image_test.sh || { rc=$$?; \
	  if [ $$rc = 77 ] && [ "$(IMAGE_TEST_ALLOW_SKIP)" = 1 ]; then echo "make image-test: SKIPPED (reason above)"; \
	  else exit $$rc; fi; }
