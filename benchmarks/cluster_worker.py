"""One worker of ``benchmarks/cluster.py``: times one scheme's gradient exchange (started by the orchestrator
inside a node's network namespace; not meant to be run by hand).

The loss is linear in the parameters, ``sum(p * c)`` with fixed per-worker coefficients ``c`` (the
gradient is ``c``), so backward costs next to nothing and the gradient hooks fire in the model's real
backward order: the wall time of ``backward()`` + ``step()`` is the exchange. Each timed step starts
after a barrier. Horovod schemes read ``HOROVOD_*`` from the environment (the orchestrator sets them as
``horovod.ray`` does); ``ddp``, ``hvdcomp-ddp``, ``fsdp`` and ``hvdcomp-fsdp`` schemes read ``RANK`` and
``WORLD_SIZE`` (hierarchical and HSDP ones also ``LOCAL_WORLD_SIZE``/``LOCAL_RANK``, as torchrun sets them) and
join ``--ddp-init``; they never import Horovod. The warm-up steps cover what is not a steady step: DDP's first
iteration (one bucket, plus the agreement MAX of hvdcomp's hook), FSDP's lazy initialisation, torch PowerSGD's
start at step 2.

Writes ``<out>/rank<R>.json``: ``step_s`` (seconds of each timed step), ``main_cpu_s`` and ``process_cpu_s``
(the CPU seconds of each timed step: of the thread that steps, and of all the worker's threads, Horovod's and Gloo's
included), ``traffic`` (per timed step, ``Traffic.as_dict()`` of hvdcomp's statistics, or null where the scheme
has none), ``elements`` (parameters) and ``payload_bits`` (bits per element of the peers' payloads, or null). Writes
the number of steps finished to ``<out>/rank<R>.progress`` after start-up and after every step, for the
orchestrator's stall watchdog.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from cluster_schemes import PAYLOAD_BITS, Scheme, parse_scheme  # noqa: E402
from models import MODELS, ResNet50  # noqa: E402

BIRDER_HYPERPARAMETERS = {"lr": 0.004, "beta": 0.95, "weight_decay": 0.1}  # the Birder paper's ResNet-50 ones


def quick_model() -> nn.Module:
    """The CIFAR ResNet-50's stem and first 7 bottleneck blocks with a 1000-way head: 1.95M parameters."""
    resnet = ResNet50()
    return nn.Sequential(resnet.stem, resnet.layers[:7], nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000))


BENCH_MODELS: dict[str, Callable[[], nn.Module]] = {**MODELS, "quick": quick_model}


class LinearLoss(nn.Module):
    """``forward()`` returns ``sum(p * c)`` over ``model``'s parameters, in forward order, so that autograd
    reaches them in reverse (backward) order. ``c`` is fixed, drawn from a per-rank generator."""

    def __init__(self, model: nn.Module, rank: int) -> None:
        super().__init__()
        self.model = model
        generator = torch.Generator().manual_seed(1000 + rank)
        self.coefficients = [torch.randn(p.shape, generator=generator) * 1e-3 for p in model.parameters()]

    def forward(self) -> torch.Tensor:
        return sum((p * c).sum() for p, c in zip(self.model.parameters(), self.coefficients))


class Run:
    """What a timed loop needs from a scheme: the module to call, the optimizer, a barrier, the statistics."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, barrier: Callable[[], None],
                 traffic: Callable[[], dict[str, float] | None], payload_bits: Callable[[], float | None]) -> None:
        self.module, self.optimizer, self.barrier = module, optimizer, barrier
        self.traffic, self.payload_bits = traffic, payload_bits


def _hvdcomp_compression(variant: str, bits: int | None) -> Any:
    import hvdcomp

    if bits is not None:
        return hvdcomp.QSGDMaxNorm(bits)
    return {"none": hvdcomp.NoCompression, "fp16": hvdcomp.FP16, "bf16": hvdcomp.BF16,
            "multiscale48": lambda: hvdcomp.QSGDMaxNormMultiScale((4, 8)),
            "randk1": lambda: hvdcomp.GlobalRandKMaxNorm(ratio=0.01),
            "powersgd1": lambda: hvdcomp.PowerSGD(rank=1)}[variant]()


def horovod_run(scheme: Scheme, model: nn.Module) -> Run:
    """horovod:*, stock:*, hvdcomp:* and local:* schemes (hvd.init here; with dynamic process sets where the route
    is hierarchical or open)."""
    import horovod.torch as hvd

    import hvdcomp

    hvd.init(process_sets="dynamic" if scheme.node_sets else None)
    module = LinearLoss(model, hvd.rank())
    named = list(model.named_parameters())
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    stats = None
    if scheme.family == "local":  # no exchange: Horovod only for the barrier
        optimizer = sgd
    elif scheme.family == "horovod":
        compression = hvd.Compression.fp16 if scheme.variant == "fp16" else hvd.Compression.none
        optimizer = hvd.DistributedOptimizer(sgd, named_parameters=named, compression=compression)
    elif scheme.family == "stock":
        compression = hvdcomp.QSGDMaxNorm(scheme.qsgd_bits)
        optimizer = hvd.DistributedOptimizer(sgd, named_parameters=named, compression=compression)
        stats = compression.stats
    elif scheme.variant == "birder":
        optimizer = hvdcomp.Birder(model.parameters(), hierarchical=scheme.hierarchical, exchange=scheme.exchange,
                                   **BIRDER_HYPERPARAMETERS)
        stats = optimizer.stats
    else:
        compression = _hvdcomp_compression(scheme.variant, scheme.qsgd_bits)
        optimizer = hvdcomp.DistributedOptimizer(sgd, named_parameters=named, compression=compression,
                                                 hierarchical=scheme.hierarchical, exchange=scheme.exchange)
        stats = optimizer.stats
    return Run(module, optimizer, hvd.barrier,
               lambda: stats.last_step.as_dict() if stats is not None else None,
               lambda: PAYLOAD_BITS.get(scheme.variant) if scheme.family == "horovod" else None)


def _hvdcomp_ddp_codec(variant: str, bits: int | None) -> Any:
    """The bucket codec of an ``hvdcomp-ddp`` variant, built as ``resolve_codec`` builds it from the ``hvdcomp``
    compressor of the same name (``QSGDMaxNorm``, ``QSGDMaxNormMultiScale``, ``GlobalRandKMaxNorm``: their
    defaults), without Horovod; ``None`` for ``none`` (``register``'s fp32 mean)."""
    from hvdcomp import BF16, FP16, MaxNormQuantizer, PowerSGD, RandomCoordinateSelector
    from hvdcomp.exchange import AheadMaxNorm, MaxNormCodec

    if bits is not None:  # QSGDMaxNorm's default scale="ahead"
        return AheadMaxNorm(MaxNormCodec(MaxNormQuantizer((bits,))))
    return {"none": lambda: None, "fp16": FP16, "bf16": BF16,
            "multiscale48": lambda: MaxNormCodec(MaxNormQuantizer((4, 8))),
            "randk1": lambda: MaxNormCodec(MaxNormQuantizer((8,)), RandomCoordinateSelector(ratio=0.01)),
            "powersgd1": lambda: PowerSGD(rank=1)}[variant]()


def _hvdcomp_ddp_run(scheme: Scheme, model: nn.Module, loss: LinearLoss) -> Run:
    """hvdcomp-ddp:* schemes: ``hvdcomp.ddp.register``'s hook on DDP, or Birder over torch.distributed
    (no DDP: Birder exchanges its own updates in ``step()``). ``:hier`` passes ``hierarchical=True``, whose
    nodes are ``LOCAL_WORLD_SIZE`` consecutive ranks."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import hvdcomp
    import hvdcomp.ddp

    if scheme.variant == "birder":
        transport = hvdcomp.ddp.TorchDistributedTransport()
        optimizer = hvdcomp.Birder(model.parameters(), hierarchical=scheme.hierarchical, transport=transport,
                                   **BIRDER_HYPERPARAMETERS)
        module, stats = loss, optimizer.stats
    else:
        module = DistributedDataParallel(loss, broadcast_buffers=False)
        codec = _hvdcomp_ddp_codec(scheme.variant, scheme.qsgd_bits)
        stats = hvdcomp.ddp.register(module, codec, hierarchical=scheme.hierarchical).stats
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return Run(module, optimizer, dist.barrier, lambda: stats.last_step.as_dict(), lambda: None)


def _fsdp_run(scheme: Scheme, model: nn.Module, loss: LinearLoss) -> Run:
    """fsdp:* and hvdcomp-fsdp:* schemes: FSDP2 with ``loss`` sharded as one module (its forward reads every
    parameter, so no submodule runs a forward of its own); ``:hsdp``: sharded over each node's
    ``LOCAL_WORLD_SIZE`` workers, replicated across nodes. ``fsdp``: FSDP's own reduce-scatter (sums, divided
    after: Gloo has no average), native HSDP's all-reduce; ``hvdcomp-fsdp``: ``hvdcomp.fsdp.register``'s."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import hvdcomp.fsdp

    nodes_by_workers = (dist.get_world_size() // int(os.environ["LOCAL_WORLD_SIZE"]),
                        int(os.environ["LOCAL_WORLD_SIZE"]))
    mesh = init_device_mesh("cpu", nodes_by_workers, mesh_dim_names=("replicate", "shard")) if scheme.hsdp else None
    reduce_dtype = torch.bfloat16 if scheme.variant == "bf16" else None
    native = scheme.family == "fsdp"
    fully_shard(loss, mesh=mesh if native or mesh is None else mesh["shard"],
                mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype))
    stats = None
    if native:
        loss.set_force_sum_reduction_for_comms(True)
    else:
        stats = hvdcomp.fsdp.register(loss, _hvdcomp_ddp_codec(scheme.variant, scheme.qsgd_bits), mesh=mesh).stats
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)  # the shards, which fully_shard put in the model
    return Run(loss, optimizer, dist.barrier, lambda: stats.last_step.as_dict() if stats is not None else None,
               lambda: PAYLOAD_BITS.get(scheme.variant) if native else None)


def ddp_run(scheme: Scheme, model: nn.Module, init_method: str) -> Run:
    """ddp:*, hvdcomp-ddp:*, fsdp:* and hvdcomp-fsdp:* schemes: torch.distributed over Gloo
    (``GLOO_SOCKET_IFNAME`` picks the interface)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    if scheme.family == "hvdcomp-ddp":
        return _hvdcomp_ddp_run(scheme, model, LinearLoss(model, rank))
    if scheme.family in ("fsdp", "hvdcomp-fsdp"):
        return _fsdp_run(scheme, model, LinearLoss(model, rank))
    module = DistributedDataParallel(LinearLoss(model, rank), broadcast_buffers=False)
    payload_bits: Callable[[], float | None] = lambda: PAYLOAD_BITS.get(scheme.variant)  # noqa: E731
    if scheme.variant == "fp16":
        module.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif scheme.variant == "bf16":
        module.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif scheme.variant == "powersgd1":
        # start_powerSGD_iter=2: the smallest torch accepts with error feedback; warm-up covers it
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        module.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

        def payload_bits() -> float | None:
            _, before, after = state.compression_stats()
            return 32.0 * after / before if before else None

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return Run(module, optimizer, dist.barrier, lambda: None, payload_bits)


def time_steps(run: Run, warmup: int, reps: int, progress: Path) -> dict[str, list[Any]]:
    """Of each of ``reps`` steps after ``warmup`` untimed ones: the seconds of backward() + step() (``step_s``), the
    CPU seconds they took on this thread (``main_cpu_s``) and on all the process's threads (``process_cpu_s``), and
    the scheme's traffic (``traffic``). ``progress`` holds the number of steps finished."""
    timed: dict[str, list[Any]] = {"step_s": [], "main_cpu_s": [], "process_cpu_s": [], "traffic": []}
    progress.write_text("0")
    for step in range(warmup + reps):
        run.optimizer.zero_grad()
        loss = run.module()
        run.barrier()
        started, main_cpu, process_cpu = time.perf_counter(), time.thread_time(), time.process_time()
        loss.backward()
        run.optimizer.step()
        elapsed = time.perf_counter() - started
        if step >= warmup:
            timed["step_s"].append(elapsed)
            timed["main_cpu_s"].append(time.thread_time() - main_cpu)
            timed["process_cpu_s"].append(time.process_time() - process_cpu)
            timed["traffic"].append(run.traffic())
        progress.write_text(str(step + 1))
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", required=True)
    parser.add_argument("--model", choices=sorted(BENCH_MODELS), required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--reps", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ddp-init", help="tcp://ADDRESS:PORT of rank 0 (ddp schemes)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scheme = parse_scheme(args.scheme)
    torch.manual_seed(0)  # the same initial weights on every worker
    model = BENCH_MODELS[args.model]()
    rank = int(os.environ["RANK"] if scheme.torch_distributed else os.environ["HOROVOD_RANK"])
    run = ddp_run(scheme, model, args.ddp_init) if scheme.torch_distributed else horovod_run(scheme, model)
    timed = time_steps(run, args.warmup, args.reps, args.out / f"rank{rank}.progress")
    # Every worker finished its last step before any exits: a step can end with a node-local collective (Birder's
    # hierarchical route), and a node that exits first shuts Horovod down under the other's last one.
    run.barrier()
    result = {**timed, "payload_bits": run.payload_bits(), "elements": sum(p.numel() for p in model.parameters())}
    partial = args.out / f"rank{rank}.json.partial"
    partial.write_text(json.dumps(result))
    partial.replace(args.out / f"rank{rank}.json")  # appears whole: the orchestrator reads it as soon as it exists


if __name__ == "__main__":
    main()
