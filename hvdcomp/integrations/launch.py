"""Starting hvdcomp under Horovod: ``hvdcomp.init`` and Horovod's hierarchical setting.

``horovodrun --hierarchical-allreduce`` exports ``HOROVOD_HIERARCHICAL_ALLREDUCE=1`` to every worker
(``--no-hierarchical-allreduce``: ``0``). ``hierarchical=None`` (the default of ``DistributedOptimizer``
and ``Birder``) follows it on every build, CPU or GPU; an explicit ``True`` / ``False`` wins. Where it is not
set, ``DistributedOptimizer`` exchanges over all workers and ``Birder`` times both routes on its first steps.

A hierarchical exchange over Horovod runs its node-local and cross-node collectives over process sets
of each node's workers and of the workers sharing a local rank. Which ranks share a node is known only
after ``hvd.init``, while static process sets must be listed, identically on every rank, before it:
so ``hvdcomp.init()`` starts Horovod with dynamic process sets (``hvd.init(process_sets="dynamic")``,
which also keeps them enabled across the re-initialisations of elastic training) and hvdcomp
registers the node sets, on every worker alike, at the first hierarchical exchange.
"""

from __future__ import annotations

import os
from typing import Any

HIERARCHICAL_SETTING = "HOROVOD_HIERARCHICAL_ALLREDUCE"
_TRUE_WORDS = ("true", "yes", "on")


def init(comm: Any = None) -> None:
    """Initialise Horovod for hvdcomp: ``hvd.init(comm, process_sets="dynamic")``.

    Use it instead of ``hvd.init()``; the rest of Horovod's API is unchanged (``hvd.add_process_set`` works
    as with ``process_sets="dynamic"``). Needed for hierarchical exchanges (``hierarchical=True``, or
    ``hierarchical=None`` under ``horovodrun --hierarchical-allreduce``) across several nodes."""
    import horovod.torch as hvd  # here: this module serves Birder, which needs no Horovod over MPITransport

    hvd.init(comm, process_sets="dynamic")


def horovod_hierarchical() -> bool | None:
    """Horovod's hierarchical setting from the environment: True, False, or None where it is not set."""
    value = os.environ.get(HIERARCHICAL_SETTING, "").strip().lower()
    if not value:
        return None
    return int(value) > 0 if value.lstrip("+-").isdigit() else value in _TRUE_WORDS


def resolve_hierarchical(hierarchical: bool | None, default: bool | None) -> bool | None:
    """``hierarchical`` if given; else Horovod's setting (``HOROVOD_HIERARCHICAL_ALLREDUCE``); else ``default``
    (None: the door measures both routes, ``hvdcomp.exchange.route``)."""
    if hierarchical is not None:
        return bool(hierarchical)
    setting = horovod_hierarchical()
    return default if setting is None else setting


def check_hierarchical(transport: Any) -> None:
    """Refuse a hierarchical exchange over ``transport`` where it cannot run, on every worker alike (over
    Horovod: nodes of different sizes, or no dynamic process sets)."""
    if not (transport.equal_nodes and transport.local_size * transport.cross_size == transport.size):
        raise ValueError("hierarchical=True needs the same number of workers on every node, the nodes covering "
                         "all workers of the exchange (the global process set); pass hierarchical=False"
                         f"{_SETTING_HINT if horovod_hierarchical() else ''}")
    transport.check_hierarchy()


_SETTING_HINT = f" ({HIERARCHICAL_SETTING} is set: hierarchical=None follows it)"
