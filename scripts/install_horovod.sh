#!/usr/bin/env bash
# Build Horovod 0.28.1 from the PyPI sdist against the installed PyTorch and install it.
#
# Horovod 0.28.1 (its last release) does not build against PyTorch >= 2.1 as shipped: its CMake asks
# for C++14 while torch's headers need C++17 (torch <= 2.13) or C++20 (torch >= 2.14). This script
# patches the standard, forces a CPU-only torch extension when no usable CUDA toolkit + NCCL + GPU
# is present, builds a wheel once, caches it (keyed by Horovod, torch, Python and flavour) and installs
# it. Re-runs with a cached wheel take seconds; re-runs with Horovod already installed take less.
#
# Supply chain: the sdist must match HOROVOD_SDIST_SHA256 (pinned below); the built wheel's sha256 is recorded
# beside it in the cache (SHA256SUMS) and checked before every install, and a cache directory that is a symlink,
# owned by another user or writable by others is refused; a wheel that fails a check is rebuilt.
#
# The gpu flavour needs nvcc, NCCL and a CUDA build of torch, but no GPU: without a CUDA driver
# (a Docker build, say) it links against the toolkit's stub libcuda when there is one, as Horovod's
# own images do (Horovod 0.28.1 itself does not link libcuda, so a toolkit without stubs works too).
#
# Environment:
#   PYTHON                   interpreter of the target environment (default: python3 on PATH)
#   HVDCOMP_HOROVOD_FLAVOUR  cpu | gpu | auto (default auto: gpu only if nvcc, NCCL and a GPU exist)
#   HOROVOD_BUILD_CUDA_CC_LIST  gpu: compute capabilities to build for, e.g. 80,90 (default: all)
#   HVDCOMP_CACHE_DIR        wheel cache (default: $XDG_CACHE_HOME/hvdcomp, else ~/.cache/hvdcomp; mode 0700)
#   HVDCOMP_FORCE_REBUILD=1  ignore the cached wheel and any installed Horovod
set -euo pipefail

HOROVOD_VERSION=0.28.1
HOROVOD_SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0  # PyPI's horovod-0.28.1.tar.gz
PYTHON=${PYTHON:-python3}
FLAVOUR=${HVDCOMP_HOROVOD_FLAVOUR:-auto}
CACHE_DIR=${HVDCOMP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdcomp}  # as hvdcomp.codec.cache.cache_dir()
FORCE=${HVDCOMP_FORCE_REBUILD:-0}

die() { echo "install_horovod: error: $*" >&2; exit 1; }
log() { echo "install_horovod: $*" >&2; }

# Succeeds if directory $1 is no symlink, is owned by this user and is not group- or world-writable.
private_dir() {
  [ -d "$1" ] && [ ! -L "$1" ] && [ "$(stat -c %u "$1")" = "$(id -u)" ] &&
    [ $((0$(stat -c %a "$1") & 022)) = 0 ]
}

# Succeeds if wheel directory $1 is private and holds exactly one wheel whose sha256 its SHA256SUMS records.
verify_wheel() {
  local dir=$1 wheels
  private_dir "$dir" && [ -f "$dir/SHA256SUMS" ] && [ ! -L "$dir/SHA256SUMS" ] || return 1
  wheels=("$dir"/horovod-*.whl)
  [ "${#wheels[@]}" = 1 ] && [ -f "${wheels[0]}" ] && [ ! -L "${wheels[0]}" ] || return 1
  [ "$(awk 'END { print NR }' "$dir/SHA256SUMS")" = 1 ] || return 1
  (cd "$dir" && sha256sum --check --strict --quiet SHA256SUMS >/dev/null 2>&1) &&
    grep -q " \*\?$(basename "${wheels[0]}")\$" "$dir/SHA256SUMS"
}

# Succeeds if file $1's sha256 is $2.
sha256_is() { [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

# Sourced (tests/test_supply_chain.py): the functions above only.
[[ "${BASH_SOURCE[0]}" == "$0" ]] || return 0

command -v "$PYTHON" >/dev/null || die "python interpreter '$PYTHON' not found (set PYTHON=...)"
"$PYTHON" -c "import torch" 2>/dev/null ||
  die "PyTorch is not importable from $PYTHON; install torch first (make venv does)"
for tool in cmake g++ make; do
  command -v "$tool" >/dev/null || die "'$tool' not found; install it (Debian: apt-get install cmake g++ make)"
done
command -v mpicxx >/dev/null ||
  die "'mpicxx' not found; install OpenMPI (Debian: apt-get install libopenmpi-dev openmpi-bin)"
for mod in setuptools wheel packaging numpy cloudpickle psutil yaml cffi; do
  "$PYTHON" -c "import $mod" 2>/dev/null ||
    die "python module '$mod' missing in $PYTHON (pip install setuptools wheel packaging numpy cloudpickle psutil pyyaml cffi)"
done

TORCH_VERSION=$("$PYTHON" -c "import torch; print(torch.__version__.split('+')[0])")
PY_TAG=$("$PYTHON" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
# torch >= 2.14 headers need C++20; 2.1 .. 2.13 need C++17.
TORCH_CXX_STD=$("$PYTHON" -c "
import torch
major, minor = (int(x) for x in torch.__version__.split('+')[0].split('.')[:2])
print(20 if (major, minor) >= (2, 14) else 17)")

# What building the gpu flavour needs; prints what is missing.
gpu_build_missing() {
  command -v nvcc >/dev/null || echo "nvcc (a CUDA toolkit, e.g. an nvidia/cuda devel image)"
  [ -n "${HOROVOD_NCCL_HOME:-}" ] || ldconfig -p | grep -q libnccl || echo "NCCL (libnccl2 + libnccl-dev, or HOROVOD_NCCL_HOME)"
  "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null ||
    echo "a CUDA build of torch"
}
gpu_present() {
  command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 &&
    "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
}
case "$FLAVOUR" in
  auto) if [ -z "$(gpu_build_missing)" ] && gpu_present; then FLAVOUR=gpu; else FLAVOUR=cpu; fi ;;
  cpu | gpu) ;;
  *) die "HVDCOMP_HOROVOD_FLAVOUR must be cpu, gpu or auto (got '$FLAVOUR')" ;;
esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ "$FLAVOUR" = gpu ]; then
  missing=$(gpu_build_missing | paste -sd ';')
  [ -z "$missing" ] || die "GPU build asked for but missing: $missing"
  if ! ldconfig -p | grep -q 'libcuda\.so\.1 '; then
    # No CUDA driver: the linker and `import horovod.torch` (the checks below) get the stub libcuda,
    # for this script only; on a GPU machine the driver's libcuda.so.1 is found as usual.
    cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}
    stubs=$cuda_home/lib64/stubs
    if [ -f "$stubs/libcuda.so" ]; then
      mkdir "$tmp/cuda-stubs" && ln -s "$stubs/libcuda.so" "$tmp/cuda-stubs/libcuda.so.1"
      export LIBRARY_PATH="$stubs${LIBRARY_PATH:+:$LIBRARY_PATH}"
      export LD_LIBRARY_PATH="$tmp/cuda-stubs:$stubs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      log "no CUDA driver here: linking against the stub libcuda in $stubs"
    else
      log "no CUDA driver and no stub libcuda in $stubs: building without (set CUDA_HOME if it is elsewhere)"
    fi
  fi
fi

# Gloo's float16 SUM has an F16C/AVX loop (gloo/math.cc) behind GLOO_USE_AVX, which Horovod neither
# defines nor compiles (math.cc is not among its Gloo's sources): its Gloo sums float16 one element at a time
# through gloo::float16's software conversions, at half fp32's speed over 1 Gbit/s. Where Horovod compiles
# with -mf16c and -mavx (its HOROVOD_BUILD_ARCH_FLAGS, by default those of the build machine's
# -march=native, found as Horovod's CMake finds them), the build adds both, and the wheel's version carries
# the local label "hvdcomp.f16c" (hvdcomp's HorovodTransport then leaves float16 sums to Horovod).
arch_flags=${HOROVOD_BUILD_ARCH_FLAGS:-$(gcc -march=native -E -v - </dev/null 2>&1 | grep cc1 || true)}
GLOO_F16C=0
if [[ " $arch_flags " == *" -mf16c "* && " $arch_flags " == *" -mavx "* ]]; then
  GLOO_F16C=1
fi
WANT_VERSION=$HOROVOD_VERSION
[ "$GLOO_F16C" = 1 ] && WANT_VERSION=$HOROVOD_VERSION+hvdcomp.f16c

KEY="horovod-${WANT_VERSION}-torch${TORCH_VERSION}-${PY_TAG}-${FLAVOUR}"
WHEEL_DIR="$CACHE_DIR/wheels/$KEY"
mkdir -p -m 700 "$CACHE_DIR" && mkdir -p -m 700 "$CACHE_DIR/wheels"
for dir in "$CACHE_DIR" "$CACHE_DIR/wheels"; do
  private_dir "$dir" || die "$dir must be a directory owned by $(id -un) and writable by no one else (not a symlink)"
done

installed_ok() {
  "$PYTHON" - "$HOROVOD_VERSION" "$WANT_VERSION" "$FLAVOUR" <<'PY' 2>/dev/null
import importlib.metadata
import sys
import horovod
import horovod.torch as hvd
want_version, want_build, flavour = sys.argv[1], sys.argv[2], sys.argv[3]
ok = (horovod.__version__ == want_version and importlib.metadata.version("horovod") == want_build
      and hvd.gloo_built() and hvd.mpi_built())
if flavour == "gpu":
    ok = ok and hvd.nccl_built()
sys.exit(0 if ok else 1)
PY
}

if [ "$FORCE" != 1 ] && installed_ok; then
  log "Horovod $HOROVOD_VERSION ($FLAVOUR) already installed and working; nothing to do"
  exit 0
fi

if [ "$FORCE" != 1 ] && [ -e "$WHEEL_DIR" ] && ! verify_wheel "$WHEEL_DIR"; then
  log "the cached wheel in $WHEEL_DIR fails its check (SHA256SUMS, owner, mode): rebuilding it"
fi
if [ "$FORCE" = 1 ] || ! verify_wheel "$WHEEL_DIR"; then
  log "building $KEY (a few minutes)"
  work=$tmp/build
  mkdir "$work"
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work" ||
    die "could not download the horovod $HOROVOD_VERSION sdist from PyPI"
  sha256_is "$work/horovod-$HOROVOD_VERSION.tar.gz" "$HOROVOD_SDIST_SHA256" ||
    die "the downloaded horovod-$HOROVOD_VERSION.tar.gz does not match its pinned sha256 $HOROVOD_SDIST_SHA256"
  tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
  src="$work/horovod-$HOROVOD_VERSION"

  sed -i 's/^set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt"
  sed -i "s/    set(CMAKE_CXX_STANDARD 14)/    set(CMAKE_CXX_STANDARD $TORCH_CXX_STD)/" \
    "$src/horovod/torch/CMakeLists.txt"
  grep -q '^set(CMAKE_CXX_STANDARD 17)' "$src/CMakeLists.txt" || die "patching CMakeLists.txt failed"
  grep -q "set(CMAKE_CXX_STANDARD $TORCH_CXX_STD)" "$src/horovod/torch/CMakeLists.txt" ||
    die "patching horovod/torch/CMakeLists.txt failed"
  if [ "$GLOO_F16C" = 1 ]; then  # Gloo's vector float16 sum (see GLOO_F16C above)
    sed -i 's|^    add_subdirectory(third_party/gloo)$|    add_definitions(-DGLOO_USE_AVX=1)\n&\n    target_sources(gloo PRIVATE "${PROJECT_SOURCE_DIR}/third_party/gloo/gloo/math.cc")|' \
      "$src/CMakeLists.txt"
    grep -q '^    target_sources(gloo PRIVATE "${PROJECT_SOURCE_DIR}/third_party/gloo/gloo/math.cc")$' \
      "$src/CMakeLists.txt" || die "patching CMakeLists.txt (Gloo's float16 sum) failed"
    export HOROVOD_LOCAL_VERSION=hvdcomp.f16c
  else
    unset HOROVOD_LOCAL_VERSION
  fi
  if [ "$FLAVOUR" = cpu ]; then
    # Tell FindPytorch that torch has no CUDA, so a CUDA build of torch beside a stray nvcc does not
    # make the configure step look for CUDA libraries that are not there.
    sed -i 's/print(True if ((torch.version.cuda is not None) and (CUDA_HOME is not None)) else False)/print(False)/' \
      "$src/cmake/Modules/FindPytorch.cmake"
    grep -q 'print(False)' "$src/cmake/Modules/FindPytorch.cmake" || die "patching FindPytorch.cmake failed"
  else
    # Horovod's CUDA kernels ask for C++11, a dialect recent CUDA toolkits are phasing out; use 17 as
    # the rest of the build does.
    sed -i 's/^set(CMAKE_CUDA_STANDARD 11)/set(CMAKE_CUDA_STANDARD 17)/' "$src/horovod/common/ops/cuda/CMakeLists.txt"
    grep -q '^set(CMAKE_CUDA_STANDARD 17)' "$src/horovod/common/ops/cuda/CMakeLists.txt" ||
      die "patching horovod/common/ops/cuda/CMakeLists.txt failed"
  fi

  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
  export HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_CPU_OPERATIONS=GLOO
  if [ "$FLAVOUR" = gpu ]; then
    export HOROVOD_GPU_OPERATIONS=NCCL
  else
    export HOROVOD_WITHOUT_GPU=1 CUDA_VISIBLE_DEVICES=""
    unset HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_BROADCAST || true
  fi
  export MAKEFLAGS="-j$(nproc)"
  mkdir -p "$work/dist"
  "$PYTHON" -m pip wheel -q --no-build-isolation --no-deps -w "$work/dist" "$src" ||
    die "building the Horovod wheel failed (see the compiler output above)"
  rm -rf "$WHEEL_DIR" && mkdir -m 700 "$WHEEL_DIR"
  cp "$work"/dist/horovod-*.whl "$WHEEL_DIR/"
  (cd "$WHEEL_DIR" && sha256sum horovod-*.whl >SHA256SUMS)
  verify_wheel "$WHEEL_DIR" || die "the wheel just built in $WHEEL_DIR fails its check"
fi

log "installing $(basename "$WHEEL_DIR"/horovod-*.whl) from the cache"
"$PYTHON" -m pip install -q --no-deps --force-reinstall "$WHEEL_DIR"/horovod-*.whl
installed_ok || die "Horovod installed but its PyTorch/Gloo/MPI support does not load"
log "Horovod $HOROVOD_VERSION ($FLAVOUR) installed"
