"""What ``rotate=True`` (``hvdcomp.codec.rotation``) buys the max-norm codecs, and what it costs; docs/rotation.md.

Three measurements, each printed as a Markdown table:

1. **Variance.** The mean squared error per element of the decoded mean of ``--workers`` gradients against their
   exact mean (exact scale, per-tensor scales, buckets of 25 MiB as ``hvdcomp.DistributedOptimizer`` plans them;
   ``--trials`` exchanges, each step its own rounding and rotation), at 2, 4 and 8 bits with and without rotation,
   for (a) real gradients: examples/models.py's digits CNN and its ResNet-50 (digits upsampled to 32x32 in 3
   channels: no download), each after ``--warm-steps`` SGD steps, one batch per worker, and (b) a heavy-tailed
   synthetic vector (Student's t, 2 degrees of freedom, independent per worker). The error is given relative to the
   mean square of the exact mean.
2. **Accuracy.** The digits demo (examples/train.py's data, model and schedule: SmallCNN, batch 32 per worker, SGD
   0.1 with momentum 0.9 and weight decay 5e-4, cosine schedule, 8 epochs) with ``QSGDMaxNorm(--accuracy-bits)``
   (scale agreed ahead, its default) with and without rotation, over seeds 0, 1, 2: a **single-process simulation**
   of the workers (``hvdcomp.exchange.simulate``: every worker's codec, bit for bit what real collectives give), one
   bucket.
3. **Cost.** Per element over the ResNet-50's gradient (per-tensor groups, 25 MiB buckets), ``--threads`` threads,
   the fastest of ``--repeats`` passes: the rotation's forward and inverse (native kernel, torch path), and the
   codec's compress + decompress with and without it (``benchmarks/codec_costs.py``'s loop; its table has the
   rotated codecs too).

    python benchmarks/rotation.py --workers 4
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train  # noqa: E402  (examples/train.py: the digits data and the learning-rate schedule)
from codec_costs import _buckets  # noqa: E402  (benchmarks/codec_costs.py: its buckets and exchange loop)
from codec_costs import _run as run_exchange  # noqa: E402
from models import ResNet50, SmallCNN  # noqa: E402

from hvdcomp import QSGDMaxNorm  # noqa: E402
from hvdcomp.codec import MaxNormQuantizer, fused  # noqa: E402
from hvdcomp.codec.rotation import HadamardRotation  # noqa: E402
from hvdcomp.exchange import MaxNormCodec  # noqa: E402
from hvdcomp.exchange.plan import plan_buckets  # noqa: E402
from hvdcomp.exchange.simulator import simulate  # noqa: E402
from hvdcomp.exchange.stats import Traffic  # noqa: E402

BITS = (2, 4, 8)
BUCKET_MB = 25.0


def digits(size: int = 8, channels: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """examples/train.py's digits split (train x, y, test x, y), the images resized to ``size`` in ``channels``."""
    train_set, test_set, _ = train.load_data(argparse.Namespace(dataset="digits"))
    x, y = train_set.tensors
    tx, ty = test_set.tensors
    if size != 8:
        x = nn.functional.interpolate(x, size=size, mode="bilinear", align_corners=False)
    return x.expand(-1, channels, -1, -1).contiguous(), y, tx, ty


def worker_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, workers: int, batch: int,
                     warm_steps: int) -> list[list[torch.Tensor]]:
    """After ``warm_steps`` SGD steps on batches of ``batch``, each worker's gradient list of its own batch."""
    gen = torch.Generator().manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss = nn.CrossEntropyLoss()
    for _ in range(warm_steps):
        index = torch.randint(len(y), (batch,), generator=gen)
        optimizer.zero_grad()
        loss(model(x[index]), y[index]).backward()
        optimizer.step()
    grads = []
    for _ in range(workers):
        index = torch.randint(len(y), (batch,), generator=gen)
        model.zero_grad()
        loss(model(x[index]), y[index]).backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
    return grads


def relative_error(grads: list[list[torch.Tensor]], bits: int, rotate: bool, trials: int) -> float:
    """Mean squared error per element of the decoded mean over the exact mean, relative to its mean square."""
    workers = len(grads)
    params = [torch.nn.Parameter(g) for g in grads[0]]
    plan = plan_buckets(params, {p: str(i) for i, p in enumerate(params)}, BUCKET_MB)
    where = {id(p): i for i, p in enumerate(params)}
    squared_error = squared = 0.0
    codecs = [MaxNormCodec(MaxNormQuantizer((bits,)), seed=1, rotate=rotate) for _ in range(workers)]
    for rank, codec in enumerate(codecs):
        codec.bind_rank(rank)
    for bucket in plan:
        flats = [torch.cat([worker[where[id(p)]].reshape(-1) for p in bucket.params]) for worker in grads]
        exact = torch.stack(flats).mean(dim=0)
        for step in range(trials):
            means = simulate([c.exchange(f, bucket.sizes, bucket.key, step, workers) for c, f in zip(codecs, flats)])
            squared_error += float((means[0] - exact).double().square().sum())
            squared += float(exact.double().square().sum())
    return squared_error / squared


def variance_table(sources: dict[str, list[list[torch.Tensor]]], trials: int) -> None:
    print("| gradient | elements | bits | relative MSE, plain | relative MSE, rotated | plain / rotated |")
    print("|---|---|---|---|---|---|")
    for name, grads in sources.items():
        numel = sum(g.numel() for g in grads[0])
        for bits in BITS:
            plain = relative_error(grads, bits, False, trials)
            rotated = relative_error(grads, bits, True, trials)
            print(f"| {name} | {numel / 1e6:.3f}M | {bits} | {plain:.3e} | {rotated:.3e} | {plain / rotated:.1f} |",
                  flush=True)


def simulated_digits_run(workers: int, seed: int, compression: Callable[[], QSGDMaxNorm] | None,
                         epochs: int) -> tuple[float, float]:
    """Top-1 (%) and mean cross-entropy on the test set of the digits demo simulated in this process: ``workers``
    replicas' batches, one bucket per step through each worker's codec (None: the exact mean)."""
    x, y, tx, ty = digits()
    torch.manual_seed(seed)
    model = SmallCNN(in_channels=1)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=5e-4)
    batch = 32
    steps_per_epoch = len(y) // (batch * workers)
    schedule = train.lr_lambda(argparse.Namespace(epochs=epochs, warmup_epochs=0.0), steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    codecs = None if compression is None else [compression().inner for _ in range(workers)]
    for rank, codec in enumerate(codecs or []):
        codec.bind_rank(rank)
    loss, sizes, step = nn.CrossEntropyLoss(), [p.numel() for p in params], 0
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=gen)
        for index in order[:steps_per_epoch * batch * workers].view(steps_per_epoch, workers, batch):
            flats = []
            for rank in range(workers):
                model.zero_grad()
                loss(model(x[index[rank]]), y[index[rank]]).backward()
                flats.append(torch.cat([p.grad.reshape(-1) for p in params]))
            if codecs is None:
                mean = torch.stack(flats).mean(dim=0)
            else:
                mean = simulate([c.exchange(f, sizes, "bucket0", step, workers) for c, f in zip(codecs, flats)])[0]
            for p, piece in zip(params, mean.split(sizes)):
                p.grad.copy_(piece.view_as(p))
            optimizer.step()
            scheduler.step()
            step += 1
    with torch.no_grad():
        logits = model(tx)
        return 100.0 * float((logits.argmax(dim=1) == ty).float().mean()), float(loss(logits, ty))


def accuracy_table(workers: int, epochs: int, bits: int) -> None:
    runs = {"fp32 (exact mean)": None,
            f"QSGDMaxNorm({bits})": lambda seed: (lambda: QSGDMaxNorm(bits, seed=seed)),
            f"QSGDMaxNorm({bits}, rotate=True)": lambda seed: (lambda: QSGDMaxNorm(bits, seed=seed, rotate=True))}
    print(f"| scheme ({workers} simulated workers, {epochs} epochs) | top-1 seed 0 | seed 1 | seed 2 | mean top-1 | "
          "mean test loss |")
    print("|---|---|---|---|---|---|")
    for name, make in runs.items():
        results = [simulated_digits_run(workers, seed, None if make is None else make(seed), epochs)
                   for seed in range(3)]
        top1, losses = zip(*results)
        print(f"| {name} | " + " | ".join(f"{t:.2f}" for t in top1) + f" | {sum(top1) / 3:.2f} | "
              f"{sum(losses) / 3:.4f} |", flush=True)


def cost_table(grads: list[torch.Tensor], workers: int, repeats: int) -> None:
    """The rotation alone (native and torch), then the codec's compress + decompress with and without it (as
    benchmarks/codec_costs.py times them), per element over ``grads`` in 25 MiB buckets: the fastest of ``repeats``
    passes, the variants interleaved in each (robust to other jobs on the machine)."""
    buckets = _buckets([g.shape for g in grads], BUCKET_MB)
    by_shape = iter(reversed(grads))  # _buckets orders the shapes backward, as backward produces them
    tensors = [[next(by_shape) for _ in bucket] for bucket in buckets]
    flats = [torch.cat([t.reshape(-1) for t in bucket]) for bucket in tensors]
    numel = sum(flat.numel() for flat in flats)
    quantizer = MaxNormQuantizer((8,))
    groups = [quantizer.scale_groups(flat.numel(), [t.numel() for t in bucket]) for flat, bucket in zip(flats, tensors)]
    rotations = {"native": HadamardRotation(), "torch": HadamardRotation()}
    codecs = {(bits, rotate): MaxNormCodec(MaxNormQuantizer((bits,)), rotate=rotate) for bits in (8, 2)
              for rotate in (False, True)}
    for codec in codecs.values():
        codec.bind_rank(0)
    best: dict[object, float] = {}
    for repeat in range(repeats + 1):  # the first is a warm-up (buffers, the kernels' build)
        for path, rotation in rotations.items():
            with fused.eager() if path == "torch" else torch.no_grad():
                for direction in ("forward", "inverse"):
                    seconds = 0.0
                    for index, (flat, group) in enumerate(zip(flats, groups)):
                        rotated = rotation.forward(flat, group, index, repeat)
                        start = time.perf_counter()
                        if direction == "forward":
                            rotation.forward(flat, group, index, repeat)
                        else:
                            rotation.inverse_(rotated, group, index, repeat)
                        seconds += time.perf_counter() - start
                    if repeat:
                        best[path, direction] = min(best.get((path, direction), float("inf")), seconds)
        for variant, codec in codecs.items():
            traffic = Traffic()
            for index, bucket in enumerate(tensors):
                run_exchange(codec, bucket, f"bucket{index}", repeat, workers, traffic)
            if repeat:
                seconds = traffic.compress_s + traffic.decompress_s
                best[variant] = min(best.get(variant, float("inf")), seconds)
    per_element = {key: 1e9 * seconds / numel for key, seconds in best.items()}
    print(f"| rotation ({torch.get_num_threads()} thread(s), best of {repeats}) | forward ns/el | inverse ns/el | "
          "both ns/el |")
    print("|---|---|---|---|")
    for path in rotations:
        forward, inverse = per_element[path, "forward"], per_element[path, "inverse"]
        print(f"| {path} | {forward:.2f} | {inverse:.2f} | {forward + inverse:.2f} |")
    print(f"\n| codec, W = {workers} (compress + decompress, best of {repeats}) | plain ns/el | rotate ns/el | "
          "extra ns/el |")
    print("|---|---|---|---|")
    for bits in (8, 2):
        plain, rotated = per_element[bits, False], per_element[bits, True]
        print(f"| QSGDMaxNorm({bits}), exact scale | {plain:.2f} | {rotated:.2f} | {rotated - plain:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--trials", type=int, default=3, help="exchanges per bucket for the variance")
    parser.add_argument("--warm-steps", type=int, default=5, help="SGD steps before the gradients are taken")
    parser.add_argument("--resnet-batch", type=int, default=8, help="per worker")
    parser.add_argument("--synthetic-numel", type=int, default=1 << 20)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--accuracy-bits", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="timed passes of the cost measurements")
    parser.add_argument("--only", nargs="*", default=("variance", "accuracy", "cost"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if "variance" in args.only or "cost" in args.only:
        x32, y32, _, _ = digits(size=32, channels=3)
        resnet = worker_gradients(ResNet50(in_channels=3), x32, y32, args.workers, args.resnet_batch,
                                  args.warm_steps)
    if "variance" in args.only:
        x, y, _, _ = digits()
        small = worker_gradients(SmallCNN(in_channels=1), x, y, args.workers, 32, args.warm_steps)
        heavy = torch.distributions.StudentT(2.0).sample((args.workers, args.synthetic_numel))
        variance_table({"digits CNN": small, "ResNet-50": resnet,
                        "Student-t (2 dof)": [[row] for row in heavy]}, args.trials)
    if "accuracy" in args.only:
        accuracy_table(args.workers, args.epochs, args.accuracy_bits)
    if "cost" in args.only:
        cost_table(resnet[0], args.workers, args.repeats)


if __name__ == "__main__":
    main()
