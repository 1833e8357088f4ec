"""Distributed training with every hvdcomp scheme: CIFAR-10 ResNet-50 / VGG-16, or an offline digits task.

    horovodrun -np 32 -H host1:8,host2:8,host3:8,host4:8 python examples/train.py \\
        --dataset cifar10 --data-dir /data/cifar10 --model resnet50 --scheme qsgd --bits 6
    torchrun --nproc-per-node 2 examples/train.py --engine ddp --scheme qsgd --bits 8   # PyTorch DDP

Two doors for Horovod: ``--wrapper hvdcomp`` (default) wraps the optimizer in ``hvdcomp.DistributedOptimizer``;
``--wrapper horovod`` in Horovod's own ``hvd.DistributedOptimizer(opt, named_parameters=...,
compression=hvdcomp.QSGDMaxNorm(8))`` (the max-norm schemes, and ``none``/``fp16`` as ``hvd.Compression.none``/
``fp16``). The config line of the log records the door, the engine and the machine (CPU, cores, versions).

Without ``--dataset`` it trains a small CNN on scikit-learn's handwritten digits (shipped with
scikit-learn: no network needed). Rank 0 writes one JSON-lines log per run (the config first, then
one line per epoch: losses, top-1/top-5 on the full test set, time split into compute /
communication / compression, bytes sent and compression ratio) to ``--log-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import horovod
import horovod.torch as hvd
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODELS  # noqa: E402

import hvdcomp  # noqa: E402
from hvdcomp import BF16, FP16, DistributedOptimizer, PowerSGD  # noqa: E402
from hvdcomp.exchange import Statistics, Traffic  # noqa: E402

MAX_NORM_SCHEMES = ("qsgd", "qsgd-multiscale", "randk", "randk-multiscale")
SCHEMES = ("none", "fp16", "bf16", *MAX_NORM_SCHEMES, "powersgd", "birder")
STOCK_SCHEMES = ("none", "fp16", *MAX_NORM_SCHEMES)  # what hvd.DistributedOptimizer's compression= takes
TORCH_ENGINES = ("ddp", "fsdp")  # launched by torchrun, over torch.distributed (ddp_engine.py)
GLOO_TIMEOUT = "HOROVOD_GLOO_TIMEOUT_SECONDS"
GLOO_TIMEOUT_PER_WORKER_PER_CORE_S = 30  # Horovod's default timeout, per worker beyond one per core


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("horovod",) + TORCH_ENGINES, default="horovod",
                   help="horovod (horovodrun), ddp (torchrun: DDP with hvdcomp's hook, see ddp_engine.py) or fsdp "
                        "(torchrun: FSDP2 with hvdcomp's reduce-scatter; --hierarchical: HSDP over nodes)")
    p.add_argument("--wrapper", choices=("hvdcomp", "horovod"), default="hvdcomp",
                   help="--engine horovod: hvdcomp.DistributedOptimizer, or Horovod's own hvd.DistributedOptimizer "
                        f"with the hvdcomp compressor ({', '.join(STOCK_SCHEMES)})")
    p.add_argument("--dataset", choices=("digits", "cifar10"), default="digits")
    p.add_argument("--data-dir", default="data", help="CIFAR-10 location (torchvision layout)")
    p.add_argument("--download", action="store_true", help="download CIFAR-10 if it is missing")
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--scheme", choices=SCHEMES, default="none")
    p.add_argument("--bits", type=int, nargs="+", default=None,
                   help="bits per level: one value (qsgd, randk) or increasing values (multiscale); default 8 / 4 8")
    p.add_argument("--ratio", type=float, default=None, help="randk: fraction of coordinates per step")
    p.add_argument("--k", type=int, default=None, help="randk: coordinates per tensor per step")
    p.add_argument("--rank", type=int, default=1, help="powersgd: approximation rank")
    p.add_argument("--error-feedback", action="store_true", help="fp16/bf16 error feedback; randk: on by default")
    p.add_argument("--no-error-feedback", action="store_true", help="randk: rescale by numel/k instead")
    p.add_argument("--hierarchical", action=argparse.BooleanOptionalAction, default=None,
                   help="full precision inside nodes, compressed between; default: as horovodrun "
                        "--hierarchical-allreduce (HOROVOD_HIERARCHICAL_ALLREDUCE) says (Birder: the faster, timed)")
    p.add_argument("--warmup-steps", type=int, default=0, help="exchange uncompressed for the first steps")
    p.add_argument("--rotate", action="store_true", help="qsgd, qsgd-multiscale: randomized Hadamard rotation")
    p.add_argument("--elastic", action="store_true",
                   help="Horovod elastic training (horovodrun --min-np/--host-discovery-script); commits every step")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help="hvdcomp's buckets (default 25); Horovod's own optimizer fuses by HOROVOD_FUSION_THRESHOLD")
    p.add_argument("--min-compress-numel", type=int, default=None,
                   help="--wrapper horovod: smaller gradients go uncompressed (default: the compressor's, 16384)")
    p.add_argument("--epochs", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=128, help="per worker")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--birder-lr", type=float, default=0.004)
    p.add_argument("--birder-beta", type=float, default=0.95)
    p.add_argument("--birder-weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-epochs", type=float, default=0.0, help="linear learning-rate warm-up")
    p.add_argument("--max-steps-per-epoch", type=int, default=None, help="for quick checks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--log-dir", default="runs")
    p.add_argument("--run-name", default=None)
    p.add_argument("--checkpoint", default=None, help="save after every epoch to CHECKPOINT.rank<N>")
    p.add_argument("--resume", default=None, help="resume from RESUME.rank<N> (as written by --checkpoint)")
    p.add_argument("--stop-after-epoch", type=int, default=None, help="exit after this epoch (to test resume)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    _check_args(p, args)
    return args


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.engine in TORCH_ENGINES and (args.elastic or args.warmup_steps):
        parser.error("--elastic and --warmup-steps are for --engine horovod")
    if args.engine == "fsdp" and (args.scheme in ("birder", "powersgd") or args.checkpoint or args.resume):
        parser.error("--engine fsdp runs the element-wise schemes, without --checkpoint/--resume")
    multiscale = args.scheme.endswith("multiscale")
    if args.bits is None:
        args.bits = [4, 8] if multiscale else [8]
    if any(not 1 <= b <= 16 for b in args.bits):
        parser.error(f"--bits must be between 1 and 16, got {args.bits}")
    if multiscale and (len(args.bits) < 2 or sorted(set(args.bits)) != args.bits):
        parser.error(f"--scheme {args.scheme} needs two or more strictly increasing --bits, got {args.bits}")
    if not multiscale and len(args.bits) != 1 and args.scheme in ("qsgd", "randk"):
        parser.error(f"--scheme {args.scheme} takes one --bits value, got {args.bits}")
    if args.scheme.startswith("randk"):
        if args.ratio is not None and args.k is not None:
            parser.error("give --ratio or --k, not both")
        if args.ratio is None and args.k is None:
            args.ratio = 0.01
        if args.ratio is not None and not 0 < args.ratio <= 1:
            parser.error(f"--ratio must be in (0, 1], got {args.ratio}")
        if args.k is not None and args.k < 1:
            parser.error(f"--k must be positive, got {args.k}")
    if args.rotate and args.scheme not in ("qsgd", "qsgd-multiscale"):
        parser.error(f"--rotate is for --scheme qsgd and qsgd-multiscale, not {args.scheme}")
    if args.rank < 1:
        parser.error(f"--rank must be positive, got {args.rank}")
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be positive")
    if args.warmup_steps < 0 or (args.warmup_steps and args.scheme == "birder"):
        parser.error("--warmup-steps must be >= 0, and Birder has no uncompressed warm-up")
    if args.wrapper == "horovod":
        _check_stock_door(parser, args)
    elif args.min_compress_numel is not None:
        parser.error("--min-compress-numel is for --wrapper horovod (hvdcomp's optimizer compresses whole buckets)")
    if args.bucket_mb is None and args.wrapper == "hvdcomp":
        args.bucket_mb = 25.0


def _check_stock_door(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what ``hvd.DistributedOptimizer(..., compression=...)`` cannot do, before any worker starts."""
    if args.engine in TORCH_ENGINES:
        parser.error("--wrapper horovod is for --engine horovod (DDP and FSDP run hvdcomp's hook)")
    if args.scheme not in STOCK_SCHEMES:
        parser.error(f"--wrapper horovod takes --scheme {', '.join(STOCK_SCHEMES)}; --scheme {args.scheme} "
                     "needs --wrapper hvdcomp (PowerSGD is a bucket codec of hvdcomp.DistributedOptimizer, "
                     "Birder an optimizer that exchanges by itself, and Horovod has no bfloat16)")
    refused = [flag for flag, given in [
        ("--bucket-mb (Horovod fuses by HOROVOD_FUSION_THRESHOLD)", args.bucket_mb is not None),
        ("--hierarchical/--no-hierarchical (Horovod follows horovodrun --hierarchical-allreduce)",
         args.hierarchical is not None),
        ("--error-feedback (hvd.Compression.fp16 has none)", args.scheme == "fp16" and args.error_feedback),
        ("--warmup-steps with --scheme none/fp16 (nothing to warm up)",
         args.warmup_steps and args.scheme in ("none", "fp16")),
        ("--min-compress-numel with --scheme none/fp16", args.min_compress_numel is not None
         and args.scheme in ("none", "fp16")),
        ("--elastic with a max-norm scheme (Horovod's elastic state does not carry the compressor's per-gradient "
         "step counts, so new workers would disagree with the others)",
         args.elastic and args.scheme in MAX_NORM_SCHEMES),
    ] if given]
    if refused:
        parser.error("--wrapper horovod does not take " + "; ".join(refused))
    if args.min_compress_numel is not None and args.min_compress_numel < 0:
        parser.error(f"--min-compress-numel must be >= 0, got {args.min_compress_numel}")


# -- data -----------------------------------------------------------------------------------------
def load_data(args: argparse.Namespace) -> tuple[Dataset, Dataset, int]:
    """(train set, test set, input channels)."""
    if args.dataset == "digits":
        from sklearn.datasets import load_digits

        images, labels = load_digits(return_X_y=True)
        x = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        x = (x - x.mean()) / x.std()
        y = torch.tensor(labels, dtype=torch.int64)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        train, test = order[:1437], order[1437:]
        return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test]), 1
    import torchvision
    from torchvision import transforms

    normalize = transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
    train_tf = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(),
                                   transforms.ToTensor(), normalize])
    test_tf = transforms.Compose([transforms.ToTensor(), normalize])
    try:
        # rank 0 downloads first; the others then find the files
        if args.download and hvd.rank() != 0:
            hvd.barrier()
        train = torchvision.datasets.CIFAR10(args.data_dir, train=True, transform=train_tf, download=args.download)
        test = torchvision.datasets.CIFAR10(args.data_dir, train=False, transform=test_tf, download=args.download)
        if args.download and hvd.rank() == 0:
            hvd.barrier()
    except RuntimeError as error:
        raise SystemExit(f"CIFAR-10 not found under {args.data_dir!r} ({error}); pass --download to fetch it, "
                         "or --data-dir to point at an existing copy") from error
    return train, test, 3


# -- scheme ---------------------------------------------------------------------------------------
def build_compression(args: argparse.Namespace) -> Any:
    """The ``compression=`` of ``--scheme`` for the chosen door (not for Birder). The max-norm compressors get
    ``--warmup-steps`` themselves, as the stock door needs (hvdcomp's optimizer is given the same value)."""
    if args.wrapper == "horovod" and args.scheme in ("none", "fp16"):
        return {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[args.scheme]
    bits = args.bits
    ef = not args.no_error_feedback
    options: dict[str, Any] = {"seed": args.seed, "warmup_steps": args.warmup_steps}
    if args.min_compress_numel is not None:
        options["min_compress_numel"] = args.min_compress_numel
    return {
        "none": lambda: None,
        "fp16": lambda: FP16(error_feedback=args.error_feedback),
        "bf16": lambda: BF16(error_feedback=args.error_feedback),
        "qsgd": lambda: hvdcomp.QSGDMaxNorm(bits[0], rotate=args.rotate, **options),
        "qsgd-multiscale": lambda: hvdcomp.QSGDMaxNormMultiScale(tuple(bits), rotate=args.rotate, **options),
        "randk": lambda: hvdcomp.GlobalRandKMaxNorm(k=args.k, ratio=args.ratio, bits=bits[0], error_feedback=ef,
                                                    **options),
        "randk-multiscale": lambda: hvdcomp.GlobalRandKMaxNormMultiScale(k=args.k, ratio=args.ratio,
                                                                          bits=tuple(bits), error_feedback=ef,
                                                                          **options),
        "powersgd": lambda: PowerSGD(rank=args.rank, seed=args.seed),
    }[args.scheme]()


def build_optimizer(args: argparse.Namespace, model: nn.Module, compression: Any) -> torch.optim.Optimizer:
    if args.scheme == "birder":
        transport = hvd.transport() if args.engine == "ddp" else None
        return hvdcomp.Birder(model.parameters(), lr=args.birder_lr, beta=args.birder_beta,
                              weight_decay=args.birder_weight_decay, hierarchical=args.hierarchical, seed=args.seed,
                              transport=transport)
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, nesterov=args.momentum > 0,
                          weight_decay=args.weight_decay)
    if args.engine in TORCH_ENGINES:
        return sgd  # DDP's hook or FSDP's reduce-scatter exchanges the gradients (main wraps the model)
    if args.wrapper == "horovod":
        return hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=compression)
    return DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=compression,
                                bucket_size_mb=args.bucket_mb, hierarchical=args.hierarchical,
                                warmup_steps=args.warmup_steps)


def door(args: argparse.Namespace) -> str:
    """What exchanges the gradients: the door of the run, as its log records it."""
    if args.scheme == "birder":
        return "hvdcomp.Birder"
    if args.engine == "ddp":
        return "torch DistributedDataParallel + hvdcomp.ddp hook"
    if args.engine == "fsdp":
        return "torch FSDP2 fully_shard + hvdcomp.fsdp reduce-scatter"
    return "hvd.DistributedOptimizer" if args.wrapper == "horovod" else "hvdcomp.DistributedOptimizer"


def lr_lambda(args: argparse.Namespace, steps_per_epoch: int):
    total, warmup = args.epochs * steps_per_epoch, args.warmup_epochs * steps_per_epoch

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return factor


# -- accounting -----------------------------------------------------------------------------------
class Meter:
    """Bytes and seconds of the exchange per epoch, from ``stats.last_step`` after each step (one
    ``hvdcomp.exchange.Statistics`` type for hvdcomp's optimizer, Birder, the DDP hook and the compressors)."""

    bytes_source = "statistics"  # where the byte counts come from, as the log records it

    def __init__(self, stats: Statistics) -> None:
        self.stats = stats
        self.reset()

    def reset(self) -> None:
        self.values: dict[str, Any] = dict(intra_node_bytes=0, inter_node_bytes=0, uncompressed_bytes=0,
                                           communicate_s=0.0, compress_s=0.0)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``, then add the step's bytes and seconds."""
        optimizer.step()
        last = self.stats.last_step
        self._add_bytes(last)
        self.values["communicate_s"] += last.communicate_s
        self.values["compress_s"] += last.compress_s + last.decompress_s

    def _add_bytes(self, last: Traffic) -> None:
        v = self.values
        v["intra_node_bytes"] += last.intra_node_bytes
        v["inter_node_bytes"] += last.inter_node_bytes + last.control_bytes
        v["uncompressed_bytes"] += last.uncompressed_bytes


class StockMeter(Meter):
    """The stock door's (``hvd.DistributedOptimizer``) bytes and seconds per epoch.

    Bytes: the hvdcomp compressor's statistics; ``hvd.Compression.none``/``fp16`` keep none, so with
    ``stats=None`` every step counts what hvdcomp's ``NoCompression``/``FP16`` count for the same exchange: one
    sum of every trainable gradient, at its own width (none) or 2 bytes an element (fp16).
    Seconds: ``communicate_s`` is the wall time of ``synchronize()``, where the stock optimizer waits for its
    all-reduces and an hvdcomp compressor runs its exchange and decoding; the codec's share of it cannot be
    told apart there, so ``compress_s`` is None (the compressor's own time in backward counts as compute).
    """

    def __init__(self, stats: Statistics | None, model: nn.Module, fp16: bool) -> None:
        trainable = [p for p in model.parameters() if p.requires_grad]
        full = sum(p.numel() * p.element_size() for p in trainable)
        sent = sum(p.numel() * 2 for p in trainable) if fp16 else full
        self.computed = Traffic(inter_node_bytes=sent, uncompressed_bytes=full)
        self.bytes_source = "statistics" if stats is not None else "computed: one sum of every gradient a step"
        super().__init__(stats)

    def reset(self) -> None:
        super().reset()
        self.values["compress_s"] = None

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``synchronize()`` (timed), then the wrapped optimizer's step, then add the step's bytes."""
        start = time.perf_counter()
        optimizer.synchronize()
        self.values["communicate_s"] += time.perf_counter() - start
        with optimizer.skip_synchronize():
            optimizer.step()
        self._add_bytes(self.computed if self.stats is None else self.stats.last_step)


def machine() -> dict[str, Any]:
    """Where the run ran: CPU model (``/proc/cpuinfo``), cores, and the versions of Python, torch, Horovod and
    hvdcomp."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines() if cpuinfo.exists() else []
    models = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return {"cpu": models[0] if models else platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "usable_cpus": usable_cpus(), "python": platform.python_version(),
            "torch": torch.__version__, "horovod": horovod.__version__, "hvdcomp": hvdcomp.__version__}


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def raise_gloo_timeout() -> None:
    """With more workers on this host than cores, workers start (each imports torch) and step in turns, and a
    worker can wait on the others longer than Gloo's default 30 s: unless ``HOROVOD_GLOO_TIMEOUT_SECONDS`` is
    set, give Gloo 30 s per worker per core. Gloo reads it in each worker's ``hvd.init()``, so this runs before;
    ``horovodrun --gloo`` tells each worker its host's worker count in ``HOROVOD_LOCAL_SIZE``."""
    workers, cores = int(os.environ.get("HOROVOD_LOCAL_SIZE", "1")), usable_cpus()
    if workers <= cores or GLOO_TIMEOUT in os.environ:
        return
    seconds = GLOO_TIMEOUT_PER_WORKER_PER_CORE_S * math.ceil(workers / cores)
    os.environ[GLOO_TIMEOUT] = str(seconds)
    if os.environ.get("HOROVOD_LOCAL_RANK") == "0":
        print(f"train.py: {workers} workers on {cores} cores start and step slowly: {GLOO_TIMEOUT}={seconds} "
              f"(Horovod's default is 30; set {GLOO_TIMEOUT} yourself to choose)", file=sys.stderr, flush=True)


def evaluate(model: nn.Module, test_set: Dataset, batch_size: int) -> dict[str, float]:
    """Loss, top-1 and top-5 over the whole test set: each worker takes every size-th example, sums in fp64."""
    shard = Subset(test_set, range(hvd.rank(), len(test_set), hvd.size()))
    totals = torch.zeros(4, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for x, y in DataLoader(shard, batch_size=batch_size):
            logits = model(x)
            top = logits.topk(min(5, logits.shape[1]), dim=1).indices
            totals += torch.tensor([
                nn.functional.cross_entropy(logits, y, reduction="sum").item(),
                (top[:, 0] == y).sum().item(), (top == y[:, None]).any(dim=1).sum().item(), len(y)],
                dtype=torch.float64)
    model.train()
    loss, top1, top5, count = hvd.allreduce(totals, op=hvd.Sum).tolist()
    return {"test_loss": loss / count, "top1": 100 * top1 / count, "top5": 100 * top5 / count}


def average_buffers(model: nn.Module) -> None:
    """BatchNorm running statistics differ per worker; evaluate with their mean."""
    for name, buffer in model.named_buffers():
        if buffer.is_floating_point():
            buffer.copy_(hvd.allreduce(buffer, op=hvd.Average, name=f"buffer.{name}"))


def load_checkpoint(prefix: str) -> dict[str, Any]:
    """This worker's checkpoint ``PREFIX.rank<N>``; at another world size W than it was saved with, worker
    ``rank % W``'s (hvdcomp keeps the model and optimizer state and starts the per-worker codec state
    afresh, with a warning)."""
    rank = hvd.rank()
    state = torch.load(f"{prefix}.rank0", weights_only=True) if rank == 0 else None
    saved_size = hvd.broadcast_object(state["world_size"] if state else None, root_rank=0, name="checkpoint.size")
    if state is None:
        state = torch.load(f"{prefix}.rank{rank % saved_size}", weights_only=True)
    return state


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.engine in TORCH_ENGINES:
        import ddp_engine

        global hvd
        hvd = ddp_engine  # the few horovod.torch calls of this script, over torch.distributed
        hvd.init()
    else:
        raise_gloo_timeout()
        hvdcomp.init()  # hvd.init with dynamic process sets, as hierarchical exchanges need
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    train_set, test_set, channels = load_data(args)
    if args.elastic:  # follows the workers as they come and go
        sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=args.seed)
    else:
        sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    steps_per_epoch = min(len(loader), args.max_steps_per_epoch or len(loader))
    if steps_per_epoch == 0:
        raise SystemExit(f"--batch-size {args.batch_size} leaves no full batch of {len(train_set) // hvd.size()} "
                         "examples per worker")
    model = MODELS[args.model](num_classes=10, in_channels=channels)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = None if args.scheme == "birder" else build_compression(args)
    # FSDP2 replaces the parameters by their shards: shard before the optimizer takes them
    sharded = hvd.shard(model, compression, args.bucket_mb, args.hierarchical) if args.engine == "fsdp" else None
    optimizer = build_optimizer(args, model, compression)
    # codec: what keeps codec state outside optimizer.state_dict() (hvdcomp's optimizer and Birder keep it in)
    codec = compression if args.wrapper == "horovod" and args.scheme in MAX_NORM_SCHEMES else sharded
    if args.engine == "ddp" and args.scheme != "birder":
        model, codec = hvd.wrap(model, compression, args.bucket_mb, args.hierarchical)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args, steps_per_epoch))
    start_epoch = 0
    if args.resume:
        state = load_checkpoint(args.resume)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if codec is not None:
            codec.load_state_dict(state["exchange"])
        schedule.load_state_dict(state["schedule"])
        start_epoch = state["epoch"] + 1
        if hvd.broadcast_object(start_epoch, root_rank=0) != start_epoch:
            raise SystemExit("workers resumed from different epochs; give every worker its own checkpoint")
    numel = sum(p.numel() for p in model.parameters())
    if args.wrapper == "horovod":
        meter: Meter = StockMeter(None if codec is None else codec.stats, model, fp16=args.scheme == "fp16")
    else:
        meter = Meter((optimizer if codec is None else codec).stats)

    stock = "-stock" if args.wrapper == "horovod" else ""  # both doors' runs of a scheme keep their own logs
    run_name = args.run_name or f"{args.dataset}-{args.model}-{args.scheme}{stock}-np{hvd.size()}"
    log_path = Path(args.log_dir) / f"{run_name}.jsonl"
    if hvd.rank() == 0 and not args.resume:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        config = dict(vars(args), door=door(args), world_size=hvd.size(), local_size=hvd.local_size(),
                      parameters=numel, steps_per_epoch=steps_per_epoch, bytes_source=meter.bytes_source,
                      machine=machine())
        log_path.write_text(json.dumps({"type": "config", **config}) + "\n", encoding="utf-8")
    started = time.time()
    loss_fn = nn.CrossEntropyLoss()

    def train(state: Any) -> None:
        """The epochs from ``state.epoch`` on; under ``--elastic``, ``hvd.elastic.run`` runs it again from the
        last commit after each change of workers (``state`` then also holds ``step``, the global step)."""
        if args.elastic:  # the learning rate of the committed step (schedules do not travel with the state)
            schedule.last_epoch = state.step - 1
            schedule.step()
        for epoch in range(state.epoch, args.epochs):
            state.epoch = epoch
            if not args.elastic or sampler.epoch != epoch:  # an elastic sampler resumes within its epoch
                sampler.set_epoch(epoch)
            meter.reset()
            epoch_start = time.perf_counter()
            train_loss = torch.zeros(2, dtype=torch.float64)
            progress = range(min(len(loader), args.max_steps_per_epoch or len(loader)))
            if hvd.rank() == 0 and not args.no_progress:
                from tqdm import tqdm

                progress = tqdm(progress, desc=f"epoch {epoch + 1}/{args.epochs}", leave=False)
            for index, (x, y) in zip(progress, loader):
                optimizer.zero_grad()
                loss = loss_fn(model(x), y)
                loss.backward()
                meter.step(optimizer)  # optimizer.step(), counting the exchange's bytes and seconds
                schedule.step()
                train_loss += torch.tensor([loss.item() * len(y), len(y)], dtype=torch.float64)
                if args.elastic:
                    sampler.record_batch(index, args.batch_size)
                    state.step += 1
                    state.commit()
            finish_epoch(epoch, time.perf_counter() - epoch_start, train_loss)
            if args.stop_after_epoch is not None and epoch + 1 >= args.stop_after_epoch:
                break

    def finish_epoch(epoch: int, epoch_seconds: float, train_loss: torch.Tensor) -> None:
        """Evaluate, log (rank 0) and checkpoint (every worker) the epoch."""
        average_buffers(model)
        metrics = evaluate(model, test_set, 512)
        train_sum, train_count = hvd.allreduce(train_loss, op=hvd.Sum).tolist()
        v = meter.values
        record = {
            "type": "epoch", "epoch": epoch + 1, "train_loss": train_sum / train_count, **metrics,
            "lr": schedule.get_last_lr()[0], "wall_s": time.time() - started, "epoch_s": epoch_seconds,
            "compute_s": epoch_seconds - v["communicate_s"] - (v["compress_s"] or 0.0),
            "communicate_s": v["communicate_s"], "compress_s": v["compress_s"],
            "intra_node_bytes": v["intra_node_bytes"], "inter_node_bytes": v["inter_node_bytes"],
            "uncompressed_bytes": v["uncompressed_bytes"],
            "compression_ratio": v["uncompressed_bytes"] / max(1, v["inter_node_bytes"]), "world_size": hvd.size(),
        }
        if not math.isfinite(record["train_loss"]):
            raise SystemExit(f"training diverged at epoch {epoch + 1} (loss {record['train_loss']})")
        if hvd.rank() == 0:
            with open(log_path, "a", encoding="utf-8") as log:
                log.write(json.dumps(record) + "\n")
            sent_mib = v["inter_node_bytes"] / 2**20
            print(f"epoch {epoch + 1}: train loss {record['train_loss']:.4f}  test loss {metrics['test_loss']:.4f}  "
                  f"top-1 {metrics['top1']:.2f}%  top-5 {metrics['top5']:.2f}%  sent {sent_mib:.2f} MiB "
                  f"(x{record['compression_ratio']:.2f})  {epoch_seconds:.1f}s", flush=True)
        if args.checkpoint:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "exchange": None if codec is None else codec.state_dict(),
                        "schedule": schedule.state_dict(), "epoch": epoch, "world_size": hvd.size(),
                        "args": vars(args)}, f"{args.checkpoint}.rank{hvd.rank()}")

    if args.elastic:
        hvd.elastic.run(train)(hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                                                      epoch=start_epoch, step=start_epoch * steps_per_epoch))
    else:
        train(argparse.Namespace(epoch=start_epoch))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
