"""A real 2-worker compressed all-reduce: QSGDMaxNorm(8) through Horovod, checked against fp32.

Run: ``make demo`` (or ``horovodrun --gloo -np 2 python examples/smoke_allreduce.py`` inside it).
Launches its own workers when started without Horovod's launcher.
"""

import os
import subprocess
import sys

import torch


def worker() -> None:
    import horovod.torch as hvd

    import hvdcomp

    hvd.init()
    torch.manual_seed(hvd.rank())
    grad = torch.randn(1_000_000)
    exact = hvd.allreduce(grad, op=hvd.Average)
    compressor = hvdcomp.QSGDMaxNorm(8)
    carrier, ctx = compressor.compress(grad)
    mean = compressor.decompress(hvd.allreduce(carrier, op=hvd.Average), ctx)
    error = (mean - exact).abs().max().item()
    if hvd.rank() == 0:
        print(f"workers: {hvd.size()}  elements: {grad.numel()}")
        print(f"bytes sent per worker: {compressor.wire_bytes} (fp32: {compressor.uncompressed_bytes}, "
              f"ratio {compressor.compression_ratio:.2f}x)")
        print(f"max |compressed mean - exact mean|: {error:.5f} (max |g| {grad.abs().max():.3f})")


if __name__ == "__main__":
    if "HOROVOD_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        worker()
    else:
        horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        sys.exit(subprocess.call([horovodrun, "--gloo", "-np", "2", sys.executable, __file__]))
