#!/usr/bin/env bash
# The GPU path's check: every codec's CUDA results against the CPU's, bit for bit, eagerly and with the fused
# (torch.compile / Triton) kernels (tests marked gpu), then the codecs' cost on the GPU
# (benchmarks/codec_costs.py --device cuda; docs/benchmarks.md, "GPU"). Needs a CUDA build of torch, Triton and
# pytest; not Horovod. Takes a few minutes (the fused kernels compile once per lane layout).
#
#   scripts/gpu_check.sh [--workers W]      # W: the world size the codecs pack for (default 8)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
workers=8
if [ "${1:-}" = "--workers" ]; then workers=$2; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$python" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_check: torch {torch.__version__} sees no CUDA device")
try:
    import pytest  # noqa: F401
except ImportError:
    sys.exit("gpu_check: needs pytest (pip install pytest)")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PY
lscpu 2>/dev/null | grep -m1 "Model name" || true

echo "== CUDA against the CPU, bit for bit (tests marked gpu)"
timeout 420 "$python" -m pytest -p no:cacheprovider -q -m gpu tests/test_gpu.py tests/test_random.py

echo "== codec costs on the GPU (W = $workers)"
HVDCOMP_FUSED=1 timeout 240 "$python" benchmarks/codec_costs.py --workers "$workers" --device cuda
