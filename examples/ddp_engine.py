"""``examples/train.py --engine ddp`` and ``--engine fsdp``: the same training over torch.distributed, launched
by torchrun.

    torchrun --nproc-per-node 2 examples/train.py --engine ddp --scheme qsgd --bits 8
    torchrun --nproc-per-node 2 examples/train.py --engine fsdp --scheme qsgd --bits 8

``train.py`` calls a handful of ``horovod.torch`` functions (``init``, ``rank``, ``size``, ``local_size``,
``allreduce``, ``broadcast_parameters``, ``broadcast_object``, ``barrier``); this module offers the same
names over torch.distributed (Gloo), so there is one training loop for every engine. ``wrap`` puts the
model in DDP with hvdcomp's hook, ``shard`` shards it with FSDP2 and hvdcomp's reduce-scatter; Birder
exchanges by itself over ``transport()``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hvdcomp.ddp
import hvdcomp.fsdp
from hvdcomp.exchange.protocol import Op

Sum, Average = "sum", "average"
_transport: hvdcomp.ddp.TorchDistributedTransport | None = None


def init() -> None:
    """Join torchrun's job (Gloo: the example trains on CPU) and build the transport of ``allreduce`` and
    Birder (collective)."""
    global _transport
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    if _transport is None:
        _transport = hvdcomp.ddp.TorchDistributedTransport()


def rank() -> int:
    return dist.get_rank()


def size() -> int:
    return dist.get_world_size()


def local_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", size()))


def allreduce(tensor: torch.Tensor, op: str = Average, name: str | None = None) -> torch.Tensor:
    """The sum (``Sum``) or mean (``Average``) over the workers, in a new tensor. Through hvdcomp's transport,
    which keeps Gloo from freeing the tensor at interpreter shutdown (see ``TorchDistributedTransport``)."""
    result = _transport.collective(Op.SUM, tensor)
    return result.div_(size()) if op == Average else result


def broadcast_parameters(state: dict[str, torch.Tensor], root_rank: int) -> None:
    for tensor in state.values():
        dist.broadcast(tensor, src=root_rank)


def broadcast_object(obj: Any, root_rank: int, name: str | None = None) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=root_rank)
    return box[0]


def barrier() -> None:
    dist.barrier()


def transport() -> hvdcomp.ddp.TorchDistributedTransport:
    """Birder's transport (nodes from torchrun's ``LOCAL_WORLD_SIZE``)."""
    return _transport


def wrap(model: nn.Module, compression: Any, bucket_mb: float, hierarchical: bool) -> tuple[nn.Module, Any]:
    """``model`` in DDP with hvdcomp's hook running ``compression``; returns (the DDP model, the hook's state,
    which has ``stats`` and ``state_dict``)."""
    ddp_model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
    return ddp_model, hvdcomp.ddp.register(ddp_model, compression, hierarchical=hierarchical)


def shard(model: nn.Module, compression: Any, bucket_mb: float, hierarchical: bool | None) -> Any:
    """Shard ``model`` in place with FSDP2 (each child holding parameters, then the whole) and give it hvdcomp's
    reduce-scatter running ``compression``; ``hierarchical``: HSDP, sharded inside torchrun's nodes and the codec
    across them. Returns the reduce-scatter's state (``stats``, ``state_dict``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (size() // local_size(), local_size()),
                            mesh_dim_names=("replicate", "shard")) if hierarchical else None
    shard_mesh = mesh["shard"] if mesh is not None else None
    for child in model.children():
        if any(p.requires_grad for p in child.parameters()):
            fully_shard(child, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return hvdcomp.fsdp.register(model, compression, mesh=mesh, bucket_size_mb=bucket_mb)
