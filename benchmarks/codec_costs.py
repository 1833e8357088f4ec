"""Wire bytes per step and codec time per MB for every scheme on a ResNet-50 gradient.

One process plays one worker of a W-worker job: each collective the codec asks for is answered as if
all W workers had sent the same tensor (sum = W x tensor, max = tensor), so the codec's own work —
compress (everything before its last collective) and decompress (after it) — is timed on this
machine, and the bytes it hands to collectives are counted. Buckets of ``--bucket-mb`` hold the
gradients in backward (reverse) order, as in ``hvdcomp.DistributedOptimizer``.

Each scheme runs eagerly and with its fused kernels (``hvdcomp.codec.fused``; compiled, or eager after a
compile failure) in the same run; the first step of each is a warm-up (caches, compiles), not timed; the
table gives both costs and their ratio, and ``ns/el`` is compress + decompress per element. The gradient has the
shapes of ``examples/models.py``'s ResNet-50 (23.52M parameters), the model ``benchmarks/cluster.py`` exchanges, so
its in-situ ``codec ns/element`` compares with this table's.

``--device cuda`` runs the codecs on the GPU (eager: torch kernels; fused: ``torch.compile``'s Triton kernels),
synchronizing before each collective and at the end so that the times are the kernels'; ``GB/s`` is the fp32
gradient's bytes over compress + decompress, to set against the device's memory bandwidth.

    python benchmarks/codec_costs.py --workers 8 [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
# this checkout's hvdcomp, not an installed one's: a second checkout times its own code
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "examples")]
from models import ResNet50  # noqa: E402

from hvdcomp.codec import MaxNormQuantizer, RandomCoordinateSelector, fused  # noqa: E402
from hvdcomp.exchange import (  # noqa: E402
    FP16,
    AheadMaxNorm,
    ElementwiseCodec,
    MaxNormCodec,
    NoCompression,
    Placement,
    PowerSGD,
    Reduction,
)
from hvdcomp.exchange.protocol import Exchange, Op, relay  # noqa: E402
from hvdcomp.exchange.stats import Traffic, counted  # noqa: E402
from hvdcomp.exchange.two_stage import TwoStageMaxNorm  # noqa: E402


def _fp16(error_feedback: bool = False, sums_float16: bool = False) -> FP16:
    """``FP16`` with its all-to-all and all-gather (Horovod, MPI), or one float16 SUM (torch.distributed)."""
    codec = FP16(error_feedback)
    codec.sums_natively = sums_float16  # what bind_transport reads from the transport
    return codec


SCHEMES = {
    "none (fp32)": lambda: NoCompression(),
    "fp16": lambda: _fp16(),
    "fp16 + error feedback": lambda: _fp16(error_feedback=True),
    "fp16, float16 SUM": lambda: _fp16(sums_float16=True),
    "fp16 + error feedback, float16 SUM": lambda: _fp16(error_feedback=True, sums_float16=True),
    "QSGDMaxNorm(8)": lambda: MaxNormCodec(MaxNormQuantizer((8,))),
    "QSGDMaxNorm(4)": lambda: MaxNormCodec(MaxNormQuantizer((4,))),
    "QSGDMaxNorm(4), scale ahead": lambda: AheadMaxNorm(MaxNormCodec(MaxNormQuantizer((4,)))),
    "QSGDMaxNorm(2)": lambda: MaxNormCodec(MaxNormQuantizer((2,))),
    "QSGDMaxNorm(4), two-stage": lambda: TwoStageMaxNorm(MaxNormCodec(MaxNormQuantizer((4,))), "two_stage"),
    "QSGDMaxNorm(4), two-stage, scale ahead": lambda: TwoStageMaxNorm(MaxNormCodec(MaxNormQuantizer((4,))), "two_stage",
                                                                     scale="ahead"),
    "QSGDMaxNorm(8, rotate)": lambda: MaxNormCodec(MaxNormQuantizer((8,)), rotate=True),
    "QSGDMaxNorm(2, rotate)": lambda: MaxNormCodec(MaxNormQuantizer((2,)), rotate=True),
    "QSGDMaxNormMultiScale(4,8)": lambda: MaxNormCodec(MaxNormQuantizer((4, 8))),
    "GlobalRandKMaxNorm(1%, 8)": lambda: MaxNormCodec(MaxNormQuantizer((8,)), RandomCoordinateSelector(ratio=0.01)),
    "PowerSGD(1)": lambda: PowerSGD(rank=1),
    "PowerSGD(2)": lambda: PowerSGD(rank=2),
}


def _buckets(shapes: list[torch.Size], bucket_mb: float) -> list[list[torch.Size]]:
    buckets, current, size = [], [], 0
    for shape in reversed(shapes):
        nbytes = 4 * shape.numel()
        if current and size + nbytes > bucket_mb * 2**20:
            buckets.append(current)
            current, size = [], 0
        current.append(shape)
        size += nbytes
    return buckets + [current]


def _reply(reduction: Reduction, tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """What rank 0 receives when all ``world_size`` workers send ``tensor``."""
    if reduction is Reduction.MAX:
        return tensor.clone()
    if reduction is Reduction.ALLTOALL:  # part 0 of every worker's tensor
        return tensor.chunk(world_size)[0].repeat(world_size)
    if reduction is Reduction.ALLGATHER:
        return tensor.repeat(world_size)
    return tensor * world_size


def _synchronized(exchange: Exchange, device: torch.device) -> Exchange:
    """``exchange``, waiting for ``device``'s queued kernels before each request and at the end (a no-op on the
    CPU), so that timing it times its kernels."""
    def wait() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def after_wait(op: Op, tensor: torch.Tensor) -> tuple[Op, torch.Tensor]:
        wait()
        return op, tensor

    value = yield from relay(exchange, after_wait)
    wait()
    return value


def _run(codec, grads: list[torch.Tensor], key: str, step: int, world_size: int, traffic: Traffic) -> None:
    """One bucket exchange, every worker sending what this one sends; bytes and seconds go to ``traffic``."""
    if isinstance(codec, ElementwiseCodec):
        flat = torch.cat([g.reshape(-1) for g in grads])
        exchange = codec.exchange(flat, [g.numel() for g in grads], key, step, world_size)
    else:
        exchange = codec.exchange(grads, key, step, world_size)
    exchange = counted(_synchronized(exchange, grads[0].device), traffic, Placement(0, world_size, world_size))
    try:
        op, tensor = next(exchange)
        while True:
            reply = _reply(op.reduction, tensor, world_size)
            op, tensor = exchange.send(reply)
    except StopIteration:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8, help="world size the codecs pack for")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--only", nargs="*", default=None, help="run the schemes whose names contain one of these")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shapes = [p.shape for p in ResNet50().parameters()]
    numel = sum(s.numel() for s in shapes)
    mb = 4 * numel / 2**20
    buckets = _buckets(shapes, args.bucket_mb)
    gen = torch.Generator().manual_seed(0)
    grads = [[(torch.randn(s, generator=gen) * 1e-3).to(device) for s in bucket] for bucket in buckets]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{args.threads} thread(s)"
    print(f"ResNet-50 gradient: {numel / 1e6:.2f}M floats ({mb:.1f} MB fp32) in {len(buckets)} buckets, "
          f"W = {args.workers}, {where}")
    print("| scheme | bytes sent per step | bits/element | eager compress ms/MB | eager decompress ms/MB | "
          "fused compress ms/MB | fused decompress ms/MB | eager / fused | fused ns/el | fused GB/s | "
          "fused warm-up s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, make in SCHEMES.items():
        if args.only and not any(part in name for part in args.only):
            continue
        costs = {}
        for path in ("eager", "fused"):
            codec = make()
            codec.bind_rank(0)
            with fused.eager() if path == "eager" else contextlib.nullcontext():
                for step in range(2):  # step 0 builds caches and compiles: not timed
                    traffic, start = Traffic(), time.perf_counter()
                    for index, bucket in enumerate(grads):
                        _run(codec, bucket, f"bucket{index}", step, args.workers, traffic)
                    if not step:
                        warmup = time.perf_counter() - start
                costs[path] = (traffic.compress_s, traffic.decompress_s)
        sent = traffic.sent_bytes
        (eager_c, eager_d), (fused_c, fused_d) = costs["eager"], costs["fused"]
        print(f"| {name} | {sent / 2**20:.2f} MiB | {8 * sent / numel:.2f} | {1e3 * eager_c / mb:.2f} | "
              f"{1e3 * eager_d / mb:.2f} | {1e3 * fused_c / mb:.2f} | {1e3 * fused_d / mb:.2f} | "
              f"{(eager_c + eager_d) / max(fused_c + fused_d, 1e-9):.1f} | {1e9 * (fused_c + fused_d) / numel:.2f} | "
              f"{4 * numel / max(fused_c + fused_d, 1e-9) / 1e9:.1f} | {warmup:.1f} |")

if __name__ == "__main__":
    main()
