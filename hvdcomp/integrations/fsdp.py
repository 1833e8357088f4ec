"""hvdcomp's element-wise bucket codecs on PyTorch FSDP2: ``register`` a compressed reduce-scatter on every
``FSDPModule`` of a model, keep its ``FSDPCompressionState``.

FSDP2 (``torch.distributed.fsdp.fully_shard``) reduces each module's gradients once per backward with its
reduce-scatter communication (``FSDPModule.set_custom_reduce_scatter``): the input is ``[W * chunk]`` in the
reduce dtype, row ``r`` of its ``[W, chunk]`` view rank ``r``'s shard (each parameter's padded shard in turn),
and the output ``[chunk]`` is this rank's row of the reduction. hvdcomp replaces that collective:

1. **Codec buckets, planned once** (at the first reduce-scatter, after FSDP's lazy initialisation): per module,
   its parameters' padded unsharded gradients (``W * shard`` elements each, in the reduce dtype), bucketed by
   ``bucket_size_mb`` (``hvdcomp.exchange.plan``), keyed and named alike on every worker.
2. **Exchange**: each worker gathers each parameter's pieces of every row (its full, padded gradient, as FSDP's
   layout holds it) into the bucket's flat float32 buffer and runs the codec's exchange over all ``W`` workers
   through the one runner (``hvdcomp.exchange.runner``): every worker quantizes its full gradient with the
   shared scale (agreed ahead or exact, as the codec says) and the packed lanes are summed by one all-reduce.
   The module's exchanges run to their end before FSDP reads the output.
3. **Write-back**: each worker takes its row of the mean (``decode`` runs over the bucket; the rows of the other
   workers are dropped), scales it so that FSDP's divide factors hold (below) and writes it, rounded to the
   reduce dtype, into FSDP's output.

**What crosses the wire** per bucket of ``n = W * shard`` elements, for ``QSGDMaxNorm(bits)``: ``Op.MAX`` of
``G + 1`` float32 (``G`` scale groups; riding in the payload with ``scale="ahead"``) and ``Op.PAYLOAD`` of
``lane_block_words(n, lanes_per_word)`` int64 words of ``bit_length(2 s W)``-bit lanes, ``s = 2**bits - 1``:
about ``n * bit_length(2 s W) / 8`` bytes, all-reduced (ring: ``2 (W - 1) / W`` times that on the wire, against
``4 n (W - 1) / W`` for FSDP's float32 reduce-scatter). ``FP16`` all-reduces ``2 n`` bytes (the wire of a
float32 reduce-scatter), ``NoCompression`` ``4 n``. ``state.stats`` counts the bytes handed to each collective.

**HSDP** (``mesh``: a 2-D ``DeviceMesh`` of ``(replicate, shard)``; the model sharded with ``fully_shard(...,
mesh=mesh["shard"])``): FSDP's reduce-scatter over the shard group stays full precision (a sum, counted as
intra-node bytes), and the codec exchanges each worker's summed shard with the ``R`` replicas holding the same
shard (one compressed all-reduce across nodes, ``n = shard`` elements over ``R`` workers). Native HSDP
(``fully_shard(..., mesh=mesh)``) would all-reduce again in full precision: ``register`` refuses it.

**Divide factors.** FSDP's ``op`` says where it divides: ``AVG`` and ``PREMUL_SUM`` (``set_gradient_divide_factor``)
inside the collective, ``SUM`` (``set_force_sum_reduction_for_comms``, float16 reduce dtype) around it. The output
is the sum over all workers divided as torch's own (HS)DP divides it: by the divide factor if set, else by the
number of workers.

**Steps.** A step ends when every planned module has reduced (``stats.steps`` counts backward passes); a module
that reduces again before that ends the step first. Before the first exchange, and after ``load_state_dict``,
all workers agree on the codec, the mesh and the plan (``hvdcomp.exchange.state``): a mismatch raises
``ConfigurationMismatchError`` on every worker. Tensor codecs (``PowerSGD``) need whole gradient matrices, which
FSDP's flat reduce-scatter input does not keep: ``TypeError`` on every worker, after that agreement.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from ..codec.validate import check_real
from ..exchange.bucket import ElementwiseCodec
from ..exchange.cost import ring_wire_bytes
from ..exchange.plan import Bucket, plan_buckets
from ..exchange.protocol import Reduction
from ..exchange.runner import Runner
from ..exchange.state import ExchangeState, ExchangeStateView, describe
from ..transport._torch_compat import ShardedLayout, default_reduce_scatter, sharded_layout
from ..transport.torch_distributed import TorchDistributedTransport
from .resolve import resolve_codec, resolve_warmup

DOOR = "hvdcomp.fsdp"
DEFAULT_BUCKET_MB = 25.0  # DDP's default bucket_cap_mb, where the codec names none


class CompressedReduceScatter:
    """FSDP's reduce-scatter communication for one module (torch's ``ReduceScatter`` protocol): ``allocate``
    plain buffers, and ``__call__`` runs the state's compressed reduction (the module docstring)."""

    def __init__(self, state: FSDPCompressionState, module: FSDPModule) -> None:
        self.state, self.module = state, module

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        """Write this rank's reduced row of ``input_tensor`` (``[W * chunk]``) into ``output_tensor``
        (``[chunk]``), both of the reduce dtype; done when it returns (no work handle)."""
        self.state.reduce_scatter(self.module, output_tensor, input_tensor, group, op)


class _ModulePlan:
    """One module's codec buckets and where each parameter lies in a row of its reduce-scatter input."""

    __slots__ = ("buckets", "place", "row_numel", "dtype")

    def __init__(self, buckets: list[Bucket], place: dict[torch.Tensor, tuple[int, int]], row_numel: int,
                 dtype: torch.dtype) -> None:
        self.buckets, self.place, self.row_numel, self.dtype = buckets, place, row_numel, dtype


class FSDPCompressionState(ExchangeStateView):
    """What the compressed reduce-scatter keeps between steps (see the module docstring); built by ``register``.

    ``stats``: ``hvdcomp.exchange.Statistics`` per backward and in total. ``state_dict()`` / ``load_state_dict()``:
    the exchange state (error-feedback memories, agreed scales, exchange step); each worker saves and loads its own.
    ``close()``: FSDP's own reduce-scatter again.
    """

    __slots__ = ("transport", "_state", "_world", "_runner", "_modules", "_names", "_bucket_size_mb", "_hsdp",
                 "_plans", "_reduced")

    def __init__(self, state: ExchangeState, transport: TorchDistributedTransport, world: TorchDistributedTransport,
                 modules: list[FSDPModule], names: dict[torch.Tensor, str], bucket_size_mb: float,
                 hsdp: bool) -> None:
        self.transport = transport  # the codec's collectives: all workers, or (HSDP) the replicas of a shard
        self._state = state
        self._world = world  # every worker: the agreement
        self._runner = Runner(transport, state.stats, DOOR, state)
        self._modules = modules
        self._names = names
        self._bucket_size_mb = bucket_size_mb
        self._hsdp = hsdp
        self._plans: dict[FSDPModule, _ModulePlan] = {}
        self._reduced: set[FSDPModule] = set()  # modules reduced in this step

    # -- checkpoints ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue exactly (``ExchangeState.state_dict``)."""
        return self._state.state_dict(self._world.size)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``state_dict()``'s output; ``ValueError`` before anything changes if it does not fit."""
        if self._reduced:
            raise RuntimeError("load_state_dict() was called in the middle of a backward pass")
        self._state.check_state(state, self._world.size)
        self._state.load_state_dict(state, self._world)

    def close(self) -> None:
        """Give every module FSDP's own reduce-scatter back; this state exchanges nothing more."""
        for module in self._modules:
            module.set_custom_reduce_scatter(default_reduce_scatter())
        self._runner.drop()
        self._reduced.clear()

    # -- the reduce-scatter ----------------------------------------------------------------------------------
    def reduce_scatter(self, module: FSDPModule, output: torch.Tensor, source: torch.Tensor, group: Any,
                       op: Any) -> None:
        """``module``'s reduction (the module docstring): ``source`` ``[W * chunk]`` in, ``output`` ``[chunk]``."""
        try:
            if not self._plans:
                self._make_plans()
            if module in self._reduced:  # the previous backward reduced fewer modules
                self._end_step()
            plan = self._plans[module]
            layout = self._check(module, plan, source, group)
            self._runner.begin_step()
            if not self._state.agreed:
                self._state.agree(self._world, f"{DOOR}.agree")
            if self._hsdp:
                source = self._sum_in_node(source, group)
            rows = source.numel() // plan.row_numel
            row = 0 if self._hsdp else dist.get_rank(group)
            grid = source.view(rows, plan.row_numel)
            times, divisor = output_scale(op, layout.divide_factor, group.size(), self.transport.size, self._world.size)

            def write_back(bucket: Bucket, means: list[torch.Tensor], keep: bool) -> None:
                for stand_in, mean in zip(bucket.params, means):
                    offset, numel = plan.place[stand_in]
                    output[offset:offset + numel].copy_(mean.view(rows, numel)[row].mul(times).div_(divisor))

            for bucket in plan.buckets:
                places = [plan.place[stand_in] for stand_in in bucket.params]
                self._runner.launch(bucket, [grid[:, offset:offset + numel] for offset, numel in places], write_back)
            self._runner.complete()
            self._reduced.add(module)
            if len(self._reduced) == len(self._plans):
                self._end_step()
        except BaseException:
            self._runner.drop()
            self._reduced.clear()
            self._state.agreed = False
            raise

    def _make_plans(self) -> None:
        """Plan every module's codec buckets (the module docstring, 1.); the next exchange agrees on them."""
        rows = 1 if self._hsdp else self._world.size
        first = 0
        for module in self._modules:
            layout = sharded_layout(module)
            stand_ins, place, offset = [], {}, 0
            for p in layout.params:
                # a stand-in for the padded gradient: its numel, dtype and device are what plans read
                stand_in = torch.empty(1, dtype=p.reduce_dtype, device=p.param.device).expand(rows * p.shard_numel)
                stand_ins.append(stand_in)
                place[stand_in] = (offset, p.shard_numel)
                offset += p.shard_numel
            names = {s: self._names[p.param] for s, p in zip(stand_ins, layout.params)}
            buckets = [Bucket(first + b.index, b.params, b.names, b.dtype)
                       for b in plan_buckets(stand_ins, names, self._bucket_size_mb)]
            first += len(buckets)
            self._plans[module] = _ModulePlan(buckets, place, offset, layout.params[0].reduce_dtype)
        self._state.plan = [bucket for plan in self._plans.values() for bucket in plan.buckets]
        self._state.agreed = False

    def _check(self, module: FSDPModule, plan: _ModulePlan, source: torch.Tensor, group: Any) -> ShardedLayout:
        layout = sharded_layout(module)
        if source.dtype != plan.dtype or source.numel() != group.size() * plan.row_numel:
            raise RuntimeError(f"{DOOR}: FSDP reduces {source.numel()} elements of {source.dtype} where the plan "
                               f"has {group.size()} x {plan.row_numel} of {plan.dtype}: every parameter must get a "
                               "gradient in every backward (module.set_reduce_scatter_unused_params(True) sends zeros "
                               "for the others), in the reduce dtype of the first backward")
        return layout

    def _sum_in_node(self, source: torch.Tensor, group: Any) -> torch.Tensor:
        """HSDP: FSDP's full-precision reduce-scatter (a sum) over the shard group, counted as intra-node bytes."""
        started = time.perf_counter()
        shard = torch.empty(source.numel() // group.size(), dtype=source.dtype, device=source.device)
        dist.reduce_scatter_single(output=shard, input=source, group=group)
        traffic = self._state.stats.last_step
        nbytes = source.numel() * source.element_size()
        traffic.intra_node_bytes += nbytes * (group.size() - 1) // group.size()
        traffic.intra_node_wire_bytes += ring_wire_bytes(Reduction.ALLTOALL, nbytes, group.size())
        traffic.communicate_s += time.perf_counter() - started
        return shard

    def _end_step(self) -> None:
        self._runner.finish()
        self._reduced.clear()


def output_scale(op: Any, divide_factor: float | None, shard_size: int, codec_workers: int,
                 workers: int) -> tuple[float, float]:
    """FSDP's output is the codec's mean times the first number, divided by the second (the module docstring's
    divide factors): the sum over all ``workers``, rounded once, then divided as torch's (HS)DP divides it.

    Args:
        op: the ``ReduceOp`` FSDP passes its reduce-scatter (``SUM``, ``AVG`` or ``PREMUL_SUM``).
        divide_factor: the module's ``set_gradient_divide_factor`` (None: unset).
        shard_size: the workers of FSDP's shard group (all of them without HSDP).
        codec_workers: the workers the codec averages over (all, or HSDP's replicas of a shard summed in-node).
        workers: all workers.
    """
    kind = getattr(op, "op", op)
    wanted = divide_factor or workers
    if kind == dist.ReduceOp.SUM:  # FSDP divides the output by its own factor afterwards
        return codec_workers * (divide_factor or shard_size), wanted
    if kind in (dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM):
        return codec_workers, wanted
    raise ValueError(f"{DOOR}: FSDP asked for a reduce-scatter with {op}; hvdcomp reduces SUM, AVG and PREMUL_SUM")


def _fsdp_modules(model: torch.nn.Module) -> list[tuple[FSDPModule, ShardedLayout]]:
    found = [(m, sharded_layout(m)) for m in model.modules() if isinstance(m, FSDPModule)]
    modules = [(m, layout) for m, layout in found if layout is not None and layout.params]
    if not modules:
        raise TypeError(f"{DOOR}.register needs a model with trainable parameters sharded by "
                        "torch.distributed.fsdp.fully_shard; call fully_shard first")
    return modules


def _ranks(group: Any) -> list[int]:
    return dist.get_process_group_ranks(group)


def _transports(layouts: list[ShardedLayout], mesh: Any) -> tuple[TorchDistributedTransport, TorchDistributedTransport]:
    """(the codec's transport, every worker's): see ``register``. Both exchange over their whole group only
    (``local_size=1``: no node subgroups to build)."""
    shard_groups = {tuple(_ranks(layout.mesh.get_group())) for layout in layouts if not layout.hsdp}
    if any(layout.hsdp for layout in layouts):
        raise ValueError(f"{DOOR}: a module is sharded with a 2-D mesh (native HSDP), whose replicas all-reduce in "
                         "full precision after the reduce-scatter; shard with fully_shard(..., mesh=mesh['shard']) "
                         f"and pass the 2-D mesh to {DOOR}.register(..., mesh=mesh)")
    if len(shard_groups) != 1:
        raise ValueError(f"{DOOR}: the modules are sharded over different groups ({sorted(shard_groups)}); shard "
                         "every module over one mesh")
    shard_group = layouts[0].mesh.get_group()
    if mesh is None:
        if shard_group.size() != dist.get_world_size():
            raise ValueError(f"{DOOR}: the modules are sharded over {shard_group.size()} of {dist.get_world_size()} "
                             f"workers; for HSDP pass the 2-D mesh: {DOOR}.register(..., mesh=mesh)")
        world = TorchDistributedTransport(shard_group, local_size=1)
        return world, world
    if mesh.ndim != 2:
        raise ValueError(f"{DOOR}: mesh must be a 2-D DeviceMesh (replicate, shard) for HSDP, got {mesh.ndim} dims")
    if mesh.size() != dist.get_world_size() or _ranks(mesh.get_group(1)) != list(next(iter(shard_groups))):
        raise ValueError(f"{DOOR}: with mesh={mesh}, shard the model with fully_shard(..., mesh=mesh[<shard dim>]) "
                         "over all workers of the default process group")
    if mesh.size(1) == 1:
        raise ValueError(f"{DOOR}: a shard dimension of size 1 reduce-scatters nothing; use hvdcomp.ddp")
    world = TorchDistributedTransport(local_size=1)
    return TorchDistributedTransport(mesh.get_group(0), local_size=1), world


def register(model: torch.nn.Module, compression: Any, *, mesh: Any = None,
             bucket_size_mb: float | None = None) -> FSDPCompressionState:
    """Give every ``FSDPModule`` in ``model`` hvdcomp's compressed reduce-scatter and return its state.

    Call it on every worker, after ``fully_shard`` and before the first backward, in the same order as the
    other collective set-up (it builds transports and agrees on the configuration: collectives).

    Args:
        model: a model whose modules ``fully_shard`` sharded (one mesh, one parameter group each).
        compression: ``None`` (fp32 mean), an element-wise bucket codec (``hvdcomp.NoCompression()``, ``FP16()``,
            a ``MaxNormCodec``, ``TwoStageMaxNorm``) or an hvdcomp compressor (``hvdcomp.QSGDMaxNorm(8)``,
            ``QSGDMaxNormMultiScale``, ``GlobalRandKMaxNorm``, ...: their codec is used). ``PowerSGD``: ``TypeError``.
        mesh: ``None``: the modules' own (1-D) mesh; or HSDP's 2-D ``DeviceMesh`` ``(replicate, shard)`` over all
            workers, the modules sharded with ``fully_shard(..., mesh=mesh[<shard dim>])`` (the module docstring).
        bucket_size_mb: size of the codec buckets within a module (default: the codec's own, else 25 MiB of
            padded unsharded gradients); the codec's state and results depend on it.

    Returns:
        the ``FSDPCompressionState``: ``stats``, ``state_dict()``, ``load_state_dict()``, ``close()``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"call torch.distributed.init_process_group(...) before {DOOR}.register")
    codec = resolve_codec(compression)
    if bucket_size_mb is None:
        bucket_size_mb = codec.bucket_mb or DEFAULT_BUCKET_MB
    check_real("bucket_size_mb", bucket_size_mb, low_open=True)
    found = _fsdp_modules(model)
    transport, world = _transports([layout for _, layout in found], mesh)
    codec.bind_transport(transport)
    shape = (transport.size, world.size // transport.size) if mesh is not None else (1, world.size)
    state = ExchangeState(codec, DOOR, {"mesh (replicas, shard)": shape}, resolve_warmup(compression, None))
    state.agree(world, f"{DOOR}.agree")  # a codec or mesh configured differently fails on every worker here
    if not isinstance(codec, ElementwiseCodec):
        raise TypeError(f"{DOOR}: {describe(codec)} exchanges whole gradient tensors; FSDP's reduce-scatter hands "
                        "flat padded shards: use an element-wise codec (QSGDMaxNorm, FP16, NoCompression, ...)")
    names = {p: name for name, p in model.named_parameters()}
    fsdp_state = FSDPCompressionState(state, transport, world, [m for m, _ in found], names, bucket_size_mb,
                                      mesh is not None)
    for module, _ in found:
        module.set_custom_reduce_scatter(CompressedReduceScatter(fsdp_state, module))
    return fsdp_state
