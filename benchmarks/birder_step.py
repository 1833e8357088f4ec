"""Nanoseconds per element of a Birder step on a ResNet-50-sized model, fused kernels on and off, in one run.

W workers run in this process (``hvdcomp.integrations.birder.simulate_step``; one node, so the exact
world route ``"world:sum"``), each with its own copy of the parameters and fixed random gradients. A
step of all W workers is timed and divided by ``W * numel``: one worker's cost per element of its step
(gathering the gradient, the moments, the draw, packing, the simulated sum, decoding, the update).
Fused and eager steps alternate (``hvdcomp.codec.fused.eager``), so a loaded machine slows both alike;
the first step of each is a warm-up (caches, compiles), not timed.

    python benchmarks/birder_step.py --workers 2 --steps 5
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
import torchvision

from hvdcomp.codec import fused
from hvdcomp.integrations.birder import Birder, simulate_step


def make_workers(world_size: int) -> list[Birder]:
    """``world_size`` Birder optimizers over ResNet-50 copies whose gradients are fixed random values."""
    template = [p.detach() for p in torchvision.models.resnet50().parameters()]
    optimizers = []
    for rank in range(world_size):
        gen = torch.Generator().manual_seed(rank)
        params = [torch.nn.Parameter(p.clone()) for p in template]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizers.append(Birder(params, lr=1e-3, hierarchical=False))
    return optimizers


def time_step(optimizers: list[Birder], use_fused: bool) -> float:
    """Seconds of one ``simulate_step`` of all workers, fused kernels on or off."""
    with contextlib.nullcontext() if use_fused else fused.eager():
        start = time.perf_counter()
        simulate_step(optimizers)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each path (after one warm-up)")
    args = parser.parse_args()
    paths = {"fused": make_workers(args.workers), "eager": make_workers(args.workers)}
    numel = sum(p.numel() for group in paths["fused"][0].param_groups for p in group["params"])
    times: dict[str, list[float]] = {name: [] for name in paths}
    for step in range(args.steps + 1):
        for name, optimizers in paths.items():
            seconds = time_step(optimizers, name == "fused")
            if step:
                times[name].append(seconds)
    per_element = {name: statistics.median(t) / (args.workers * numel) * 1e9 for name, t in times.items()}
    print(f"Birder step, {args.workers} workers in one process, {numel} elements, median of {args.steps} steps")
    for name, ns in per_element.items():
        print(f"  {name:5s}  {ns:6.2f} ns/el per worker")
    print(f"  eager / fused = {per_element['eager'] / per_element['fused']:.2f}")


if __name__ == "__main__":
    main()
