"""torch's private FSDP2 API, in one place, behind a version gate.

``hvdcomp.fsdp`` reads what ``torch.distributed.fsdp.fully_shard`` does not publish, all of it here:

- ``sharded_layout``: an ``FSDPModule``'s parameter group, parameter by parameter in the order its
  reduce-scatter input lays them out (``FSDPParam``: the sharded parameter, its padded shard's element
  count, the reduce dtype), its mesh, whether it is HSDP (a 2-D mesh), and its gradient divide factor;
- ``default_reduce_scatter``: FSDP's own reduce-scatter communication (``DefaultReduceScatter``), what
  ``close`` puts back.

The custom communication itself (``FSDPModule.set_custom_reduce_scatter``) is public: FSDP calls
``comm.allocate(size, dtype=, device=)`` for its buffers and ``comm(output_tensor=, input_tensor=, group=, op=)``
once per backward, with ``input_tensor`` ``[W * chunk]``: row ``r`` of its ``[W, chunk]`` view is rank ``r``'s shard,
each parameter's padded shard in turn.

Each function checks once, at its first use, that the installed torch is in ``SUPPORTED_TORCH`` and raises
``RuntimeError`` naming the installed and the supported versions otherwise.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import torch

LOWEST = (2, 14)  # the oldest torch whose FSDP2 internals are these
BELOW = (2, 15)  # the first torch not checked
SUPPORTED_TORCH = f">={'.'.join(map(str, LOWEST))},<{'.'.join(map(str, BELOW))}"


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"2.14.1+cpu"`` -> ``(2, 14, 1)``."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


@functools.cache
def check_torch() -> None:
    """Raise ``RuntimeError`` unless the installed torch is in ``SUPPORTED_TORCH`` (checked once)."""
    if not LOWEST <= _release(torch.__version__) < BELOW:
        raise RuntimeError(f"hvdcomp.fsdp reads FSDP2 internals checked for torch {SUPPORTED_TORCH}, but torch "
                           f"{torch.__version__} is installed")


@dataclass(frozen=True)
class ShardedParameter:
    """One parameter of an FSDP parameter group: the sharded ``nn.Parameter`` the model lists, the elements of
    its padded shard (its piece of every row of the reduce-scatter input) and the dtype gradients reduce in."""

    param: torch.nn.Parameter
    shard_numel: int
    reduce_dtype: torch.dtype | None  # None before FSDP's lazy initialisation


@dataclass(frozen=True)
class ShardedLayout:
    """An ``FSDPModule``'s parameter group (see the module docstring); ``params`` in reduce-scatter order, those
    that require gradients only."""

    params: tuple[ShardedParameter, ...]
    mesh: Any
    hsdp: bool
    divide_factor: float | None


def sharded_layout(module: Any) -> ShardedLayout | None:
    """``module``'s parameter group (``None`` if it holds no parameters); after FSDP's lazy initialisation
    (the first forward) for the reduce dtypes. ``ValueError`` for several groups (``shard_placement_fn`` meshes)."""
    check_torch()
    groups = module._get_fsdp_state()._fsdp_param_groups
    if not groups:
        return None
    if len(groups) > 1:
        raise ValueError("hvdcomp.fsdp needs one parameter group per fully_shard module; per-parameter meshes "
                         "(shard_placement_fn) are not supported")
    group = groups[0]
    params = tuple(ShardedParameter(p.sharded_param, p.padded_sharded_param_size.numel(), _reduce_dtype(p))
                   for p in group.fsdp_params if p.sharded_param.requires_grad)
    info = group.mesh_info
    return ShardedLayout(params, info.mesh, info.mesh.ndim == 2, group.gradient_divide_factor)


def _reduce_dtype(fsdp_param: Any) -> torch.dtype | None:
    """The dtype FSDP reduces ``fsdp_param``'s gradient in: the policy's ``reduce_dtype``, else the gradient's own
    (``param_dtype``, else the parameter's); None before the lazy initialisation sets them."""
    if not hasattr(fsdp_param, "orig_dtype"):
        return None
    return fsdp_param.reduce_dtype or fsdp_param.param_dtype or fsdp_param.orig_dtype


def default_reduce_scatter() -> Any:
    """FSDP's own reduce-scatter communication."""
    check_torch()
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    return DefaultReduceScatter()
