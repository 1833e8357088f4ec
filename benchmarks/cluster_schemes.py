"""Scheme names of ``benchmarks/cluster.py``: ``family:variant`` with optional ``:hier`` or ``:auto``,
``:two_stage`` or ``:auto_exchange``, and ``:hsdp`` suffixes (in that order).

Families:

- ``horovod``: stock ``hvd.DistributedOptimizer``; ``fp32`` (``Compression.none``), ``fp16``. No ``bf16``:
  Horovod 0.28 has no bfloat16 tensors (``hvd.allreduce`` refuses them) and no bf16 ``Compression``;
- ``ddp``: torch ``DistributedDataParallel`` over Gloo; ``fp32``, ``fp16`` (``fp16_compress_hook``), ``bf16``
  (``bf16_compress_hook``), ``powersgd1`` (``powerSGD_hook``, rank 1);
- ``hvdcomp``: ``hvdcomp.DistributedOptimizer`` with ``none``, ``fp16``, ``bf16``, ``qsgd<bits>``,
  ``multiscale48`` (bits 4 and 8), ``randk1`` (1% of each tensor, 8 bits), ``powersgd1``; or ``birder``
  (``hvdcomp.Birder``). ``:hier`` makes the exchange hierarchical (full precision inside a node, the
  compressed payload between nodes);
- ``hvdcomp-ddp``: the same variants on torch DDP over Gloo, without Horovod: ``hvdcomp.ddp.register``'s
  hook with ``None`` (``none``), ``FP16()``, ``BF16()``, ``MaxNormCodec``s (``qsgd<bits>``, ``multiscale48``,
  ``randk1``) or ``PowerSGD(rank=1)``; ``birder``: ``hvdcomp.Birder`` over a ``TorchDistributedTransport``, no DDP.
  ``:hier`` as for ``hvdcomp``;
- ``stock``: stock ``hvd.DistributedOptimizer(compression=hvdcomp.QSGDMaxNorm(<bits>))``: ``qsgd<bits>``;
- ``fsdp``: torch FSDP2 (``fully_shard``) over Gloo with its own reduce-scatter, ``fp32`` or ``bf16``
  (``reduce_dtype=torch.bfloat16``);
- ``hvdcomp-fsdp``: FSDP2 with ``hvdcomp.fsdp.register``'s reduce-scatter and the ``hvdcomp-ddp`` codec of the
  element-wise variants (``none``, ``fp16``, ``qsgd<bits>``, ``multiscale48``, ``randk1``);
- ``local``: ``sgd``, each worker's torch SGD step on its own gradient, with no exchange at all (Horovod workers,
  for the barrier only): the floor of a timed step on this machine, which no scheme can beat. Its speed-up over
  ``horovod:fp32`` is the most any scheme could gain in the same run (docs/benchmarks.md#the-floor-of-a-step).

``:auto`` (``hvdcomp:birder`` and ``hvdcomp-ddp:birder``) leaves the route open (``hierarchical=None``, Birder's
default): Birder times both routes on its first steps (``hvdcomp.exchange.route``; give ``--warmup`` at least
``2 (TRIAL_ROUNDS + 1) + 1`` steps to time the route it keeps). Without ``:hier`` or ``:auto``, ``hierarchical=False``.

``:two_stage`` (``hvdcomp:qsgd<bits>`` and ``hvdcomp:birder``) passes ``exchange="two_stage"``: the
constant-bit exchange of ``hvdcomp.exchange.two_stage`` instead of summed lanes (``QSGDMaxNorm`` with its default
scale, agreed ahead); ``:auto_exchange`` (the same schemes) passes ``exchange="auto"``, which leaves that choice to
the optimizer (``hvdcomp:qsgd<bits>``: its trial takes the first ``2 (EXCHANGE_TRIAL_ROUNDS + 1)`` steps, 12, and
the exchange it keeps runs from the next; give ``--warmup`` at least 12). ``:hsdp`` (``fsdp`` and
``hvdcomp-fsdp``) shards inside each node and replicates across nodes (HSDP): full precision inside, and for
``hvdcomp-fsdp`` the codec across nodes; it needs several workers per node.

Pure (no torch, no Horovod): both the orchestrator and the workers import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FAMILIES = {
    "horovod": ("fp32", "fp16"),
    "ddp": ("fp32", "fp16", "bf16", "powersgd1"),
    "hvdcomp": ("none", "fp16", "bf16", "qsgd<bits>", "multiscale48", "randk1", "powersgd1", "birder"),
    "hvdcomp-ddp": ("none", "fp16", "bf16", "qsgd<bits>", "multiscale48", "randk1", "powersgd1", "birder"),
    "stock": ("qsgd<bits>",),
    "fsdp": ("fp32", "bf16"),
    "hvdcomp-fsdp": ("none", "fp16", "qsgd<bits>", "multiscale48", "randk1"),
    "local": ("sgd",),
}
QSGD = re.compile(r"qsgd([1-9]|1[0-6])")
HIERARCHICAL_FAMILIES = ("hvdcomp", "hvdcomp-ddp")
HSDP_FAMILIES = ("fsdp", "hvdcomp-fsdp")
TORCH_DISTRIBUTED_FAMILIES = ("ddp", "hvdcomp-ddp", *HSDP_FAMILIES)  # workers join torch.distributed, not Horovod
PAYLOAD_BITS = {"fp32": 32, "fp16": 16, "bf16": 16}  # bits per element of the uncompressed peers' payloads
SIXTEEN_BIT_PEERS = ("horovod:fp16", "ddp:fp16", "ddp:bf16")  # the 16-bit all-reduces compression must beat

DEFAULT = ("horovod:fp32", "horovod:fp16", "ddp:fp32", "ddp:fp16", "ddp:bf16", "ddp:powersgd1", "hvdcomp:none",
           "hvdcomp:fp16", "hvdcomp:bf16", "hvdcomp:qsgd2", "hvdcomp:qsgd4", "hvdcomp:qsgd8", "hvdcomp:multiscale48",
           "hvdcomp:randk1", "hvdcomp:powersgd1", "hvdcomp:birder", "stock:qsgd4", "hvdcomp-ddp:fp16",
           "hvdcomp-ddp:bf16", "hvdcomp-ddp:qsgd4",
           "hvdcomp-ddp:powersgd1", "local:sgd")  # the other hvdcomp-ddp ones on request (--schemes)
HIERARCHICAL_DEFAULT = ("hvdcomp:fp16:hier", "hvdcomp:qsgd4:hier", "hvdcomp:powersgd1:hier", "hvdcomp:birder:hier")
FSDP_DEFAULT = ("fsdp:fp32", "fsdp:bf16", "hvdcomp-fsdp:qsgd4")
FSDP_HIERARCHICAL_DEFAULT = ("hvdcomp-fsdp:qsgd4:hsdp",)
QUICK = ("horovod:fp32", "horovod:fp16", "ddp:fp16", "hvdcomp:none", "hvdcomp:qsgd4", "hvdcomp:powersgd1",
         "hvdcomp:birder", "stock:qsgd4", "hvdcomp-ddp:qsgd4", "local:sgd")


@dataclass(frozen=True)
class Scheme:
    family: str
    variant: str
    hierarchical: bool | None = False  # None: the route left open (``:auto``)
    exchange: str = "lanes"  # the ``exchange=`` argument of hvdcomp's optimizers: "lanes", "two_stage" or "auto"
    hsdp: bool = False

    @property
    def name(self) -> str:
        route = ":hier" if self.hierarchical else ":auto" if self.hierarchical is None else ""
        exchange = {"lanes": "", "two_stage": ":two_stage", "auto": ":auto_exchange"}[self.exchange]
        return f"{self.family}:{self.variant}{route}{exchange}" + (":hsdp" if self.hsdp else "")

    @property
    def node_sets(self) -> bool:
        """Whether Horovod workers need node-local process sets (a hierarchical route, or one left open)."""
        return self.hierarchical is not False

    @property
    def torch_distributed(self) -> bool:
        """Whether the workers join torch.distributed (``RANK``, ``WORLD_SIZE``, ``--ddp-init``), not Horovod."""
        return self.family in TORCH_DISTRIBUTED_FAMILIES

    @property
    def qsgd_bits(self) -> int | None:
        match = QSGD.fullmatch(self.variant)
        return int(match.group(1)) if match else None


def parse_scheme(name: str) -> Scheme:
    """``"hvdcomp:qsgd4:hier"`` -> ``Scheme("hvdcomp", "qsgd4", True)``; ValueError naming the choices."""
    parts = name.strip().split(":")
    family, variant, suffixes = (parts + [""])[0], (parts + [""])[1], parts[2:]
    hierarchical, hsdp = "hier" in suffixes, "hsdp" in suffixes
    exchange = "two_stage" if "two_stage" in suffixes else "auto" if "auto_exchange" in suffixes else "lanes"
    route_open = "auto" in suffixes
    known = FAMILIES.get(family, ())
    valid = variant in known or ("qsgd<bits>" in known and QSGD.fullmatch(variant) is not None)
    in_order = suffixes == [s for s in ("hier", "auto", "two_stage", "auto_exchange", "hsdp") if s in suffixes]
    if len(parts) < 2 or not in_order or not valid or {"two_stage", "auto_exchange"} <= set(suffixes):
        choices = "; ".join(f"{f}:{{{','.join(v)}}}" for f, v in FAMILIES.items())
        raise ValueError(f"unknown scheme {name!r}: choose from {choices} (bits 1..16), hvdcomp and hvdcomp-ddp "
                         "ones with an optional :hier suffix (:auto for their birder), hvdcomp:qsgd<bits> and "
                         "hvdcomp:birder with :two_stage or :auto_exchange, "
                         "fsdp and hvdcomp-fsdp ones with :hsdp")
    if hierarchical and family not in HIERARCHICAL_FAMILIES:
        raise ValueError(f"scheme {name!r}: only hvdcomp and hvdcomp-ddp schemes have a hierarchical (:hier) "
                         "variant")
    if route_open and (hierarchical or family not in HIERARCHICAL_FAMILIES or variant != "birder"):
        raise ValueError(f"scheme {name!r}: only hvdcomp:birder and hvdcomp-ddp:birder leave the route open (:auto, "
                         "not with :hier); the other hvdcomp schemes' default route is flat")
    if exchange != "lanes" and (family != "hvdcomp" or not (variant == "birder" or QSGD.fullmatch(variant))):
        raise ValueError(f"scheme {name!r}: only hvdcomp:qsgd<bits> and hvdcomp:birder have :two_stage and "
                         ":auto_exchange variants")
    if hsdp and family not in HSDP_FAMILIES:
        raise ValueError(f"scheme {name!r}: only fsdp and hvdcomp-fsdp schemes have an HSDP (:hsdp) variant")
    return Scheme(family, variant, None if route_open else hierarchical, exchange, hsdp)


def default_schemes(workers_per_node: int) -> list[str]:
    """Every scheme of the issue, plus the hierarchical ones when nodes have several workers."""
    hierarchical = HIERARCHICAL_DEFAULT + FSDP_HIERARCHICAL_DEFAULT if workers_per_node > 1 else ()
    return list(DEFAULT + FSDP_DEFAULT + hierarchical)
