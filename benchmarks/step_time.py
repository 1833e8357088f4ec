"""Seconds per training step of the exchange alone, per scheme, on real Horovod workers.

The model is the CIFAR ResNet-50 of ``examples/models.py`` (23.52M parameters) with the loss
``sum(p * c)`` over its parameters (fixed random ``c``): backward costs almost nothing, so the time of
``backward()`` + ``step()`` is the exchange, with the gradient hooks firing in real backward order.
Each scheme gets a fresh model and optimizer, ``--warmup`` untimed steps, then the median of
``--steps`` timed ones. Rank 0 prints one line per scheme with its ratio to Horovod fp32 measured in
the same run.

    horovodrun --gloo -np 2 python benchmarks/step_time.py
    horovodrun --gloo -np 2 python benchmarks/step_time.py --schemes hvd-fp32 hvd-fp16 ours-fp16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hvdcomp  # noqa: E402
from examples.models import ResNet50  # noqa: E402


def _stock(compression: Callable[[], Any]) -> Callable[[torch.nn.Module, torch.optim.Optimizer], Any]:
    return lambda model, sgd: hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                                       compression=compression())


def _ours(compression: Callable[[], Any]) -> Callable[[torch.nn.Module, torch.optim.Optimizer], Any]:
    return lambda model, sgd: hvdcomp.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                                           compression=compression())


SCHEMES: dict[str, Callable[[torch.nn.Module, torch.optim.Optimizer], Any]] = {
    "hvd-fp32": _stock(lambda: hvd.Compression.none),
    "hvd-fp16": _stock(lambda: hvd.Compression.fp16),
    "stock-qsgd4-ahead": _stock(lambda: hvdcomp.QSGDMaxNorm(4)),
    "stock-qsgd4-exact": _stock(lambda: hvdcomp.QSGDMaxNorm(4, scale="exact")),
    "ours-none": _ours(hvdcomp.NoCompression),
    "ours-fp16": _ours(hvdcomp.FP16),
    "ours-qsgd4": _ours(lambda: hvdcomp.QSGDMaxNorm(4)),
}


def time_scheme(build: Callable[[torch.nn.Module, torch.optim.Optimizer], Any], warmup: int,
                steps: int) -> tuple[float, str]:
    """Median seconds of ``backward()`` + ``step()`` for one scheme (the same on every rank: the max), and
    rank 0's codec seconds of the last step where the scheme counts them."""
    torch.manual_seed(0)
    model = ResNet50()
    coefficients = [torch.randn_like(p) for p in model.parameters()]
    optimizer = build(model, torch.optim.SGD(model.parameters(), lr=1e-6))
    seconds = []
    for index in range(warmup + steps):
        optimizer.zero_grad()
        hvd.barrier()
        start = time.perf_counter()
        loss = sum((p * c).sum() for p, c in zip(model.parameters(), coefficients))
        loss.backward()
        optimizer.step()
        elapsed = hvd.allreduce(torch.tensor(time.perf_counter() - start), op=hvd.Max, name=f"time.{index}")
        if index >= warmup:
            seconds.append(float(elapsed))
    close = getattr(optimizer, "close", None)
    if close is not None:
        close()
    counted = getattr(getattr(optimizer, "_compression", optimizer), "stats", None)
    last = getattr(counted, "last_step", None)
    codec = "" if last is None else (f"  compress {last.compress_s:.3f} s, communicate {last.communicate_s:.3f} s, "
                                     f"decompress {last.decompress_s:.3f} s")
    return statistics.median(seconds), codec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hvd.init()
    times = {name: time_scheme(SCHEMES[name], args.warmup, args.steps) for name in args.schemes}
    if hvd.rank() == 0:
        base = times.get("hvd-fp32")
        print(f"W = {hvd.size()}, median of {args.steps} steps")
        for name, (seconds, codec) in times.items():
            ratio = f"  fp32/this {base[0] / seconds:.2f}x" if base else ""
            print(f"{name:20s} {seconds:7.3f} s{ratio}{codec}")


if __name__ == "__main__":
    main()
