"""Birder in real Horovod workers: flat (Gloo, np=2), hierarchical over 2 emulated nodes x 2 (Gloo,
dynamic process sets) and over mpi4py (mpirun, ``MPITransport(local_size=2)``); the route left open over 2 x 2.

One launch per configuration. Each worker runs a few steps on synthetic gradients (one step with a NaN
on rank 1, which every worker must skip), checkpoints half-way and resumes from the checkpoint into
fresh parameters and a fresh optimizer. The test then checks that the replicas agree bitwise, that the
run equals the same steps replayed in this process through ``protocol.simulate`` (so the transports
carry the exchange exactly), the bytes per step against the documented formulas, and the resume.
"""

import contextlib
import math

import pytest
import torch

from hvdcomp.exchange.cost import choose_inter_node
from hvdcomp.exchange.route import TRIAL_ROUNDS
from hvdcomp.integrations.birder import Birder, simulate_step
from tests.harness import run_function

SHAPES = [(40, 25), (7,), (3, 3)]  # params[2]'s gradient is always zero
STEPS, CHECKPOINT, NAN_STEP = 5, 2, 3
OPTIONS = {"lr": 0.01, "beta": 0.9, "weight_decay": 0.05, "seed": 11, "hierarchical": True}


def _params():
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]


def _set_grads(params, rank, step):
    gen = torch.Generator().manual_seed(100 * step + rank)
    params[0].grad = torch.randn(params[0].shape, generator=gen) + 0.2 * rank
    params[1].grad = torch.randn(7, generator=gen) if rank else None
    params[2].grad = torch.zeros(3, 3)
    if step == NAN_STEP and rank == 1:
        params[0].grad[0, 0] = float("inf")


def _worker(inter_node, mpi_local_size=None, chunk_elements=None):
    """Steps 0..STEPS-1 with a checkpoint after CHECKPOINT steps, then the resumed run of the rest;
    ``chunk_elements``: the world route's chunks (several sums in flight together)."""
    import warnings

    import horovod.torch as hvd

    from hvdcomp import MPITransport
    from hvdcomp.exchange import onebit

    if chunk_elements:
        onebit.WORLD_CHUNK_ELEMENTS = chunk_elements

    transport = MPITransport(local_size=mpi_local_size) if mpi_local_size else None
    params = _params()
    optimizer = Birder(params, inter_node=inter_node, transport=transport, **OPTIONS)
    stats, checkpoint = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(STEPS):
            if step == CHECKPOINT:
                checkpoint = ([p.detach().clone() for p in params], optimizer.state_dict())
            _set_grads(params, hvd.rank(), step)
            optimizer.step()
            stats.append({**optimizer.stats.last_step.as_dict(), "skipped_steps": optimizer.stats.skipped_steps,
                          "route": optimizer.route})
        resumed = [torch.nn.Parameter(t.clone()) for t in checkpoint[0]]
        again = Birder(resumed, inter_node=inter_node, transport=transport, **{**OPTIONS, "lr": 1.0})
        again.load_state_dict(checkpoint[1])
        for step in range(CHECKPOINT, STEPS):
            _set_grads(resumed, hvd.rank(), step)
            again.step()
    # The last collectives are node-local: without a global barrier, a node that finishes first exits
    # and shuts Horovod down under the other node's last local_allgather.
    hvd.barrier()
    topology = optimizer.transport
    return {
        "topology": (topology.rank, topology.size, topology.local_size, topology.cross_size),
        "params": [p.detach() for p in params],
        "resumed": [p.detach() for p in resumed],
        "stats": stats,
        "warnings": [str(w.message) for w in caught],
    }


def _replay(world_size, local_size, inter_node):
    """The same steps in this process."""
    params = [_params() for _ in range(world_size)]
    opts = [Birder(p, inter_node=inter_node, **OPTIONS) for p in params]
    for step in range(STEPS):
        for rank, p in enumerate(params):
            _set_grads(p, rank, step)
        with pytest.warns(RuntimeWarning) if step == NAN_STEP else contextlib.nullcontext():
            simulate_step(opts, local_size)
    return [[p.detach() for p in ps] for ps in params]


def _lanes(k):
    return 63 // k.bit_length()


def _world_sum_bytes(numel, k):
    """Bytes of the world route's words: whole blocks of 16 words in the blocked order."""
    return 8 * 16 * math.ceil(numel / (16 * _lanes(k)))


def _check(results, world_size, local_size, inter_node):
    numel = sum(math.prod(s) for s in SHAPES)
    num_nodes = world_size // local_size
    replay = _replay(world_size, local_size, inter_node)
    start = _params()
    for rank, r in enumerate(results):
        assert r["topology"] == (rank, world_size, local_size, num_nodes)
        for a, b, c in zip(r["params"], results[0]["params"], replay[rank]):
            assert torch.equal(a, b) and torch.equal(a, c)  # replicas agree, and equal the simulation
        for a, b in zip(r["params"], r["resumed"]):
            assert torch.equal(a, b)  # resume is exact
        # the always-zero gradient: weight decay only (4 applied steps; the NaN step is skipped)
        expected = start[2].detach().clone()
        for _ in range(STEPS - 1):
            expected.mul_(1 - OPTIONS["lr"] * OPTIONS["weight_decay"])
        assert torch.equal(r["params"][2], expected)
        assert any("NaN/Inf" in w for w in r["warnings"])

        for step, s in enumerate(r["stats"]):
            skipped = step == NAN_STEP
            assert s["skipped_steps"] == int(step >= NAN_STEP)
            assert s["uncompressed_bytes"] == (0 if skipped else 4 * numel)
            flags = 8 * (4 + len(SHAPES))  # the Op.MAX: 4 flags, then one per parameter (has a gradient)
            assert s["control_bytes"] == flags + (8 * math.ceil(numel / _lanes(world_size)) if step == 0 else 0)
            if skipped:
                assert s["inter_node_bytes"] == s["intra_node_bytes"] == 0
                continue
            if num_nodes == 1:  # flat: one lane sum, bit_length(W) bits per element
                assert s["route"] == "world:sum" and s["intra_node_bytes"] == 0
                assert s["inter_node_bytes"] == _world_sum_bytes(numel, world_size)
                continue
            chunk = math.ceil(numel / local_size)
            variant = choose_inter_node(num_nodes, chunk) if inter_node == "auto" else inter_node
            assert s["route"] == f"hierarchical:{variant}"
            inter = math.ceil(chunk / 8) if variant == "allgather" else 8 * math.ceil(chunk / _lanes(num_nodes))
            assert s["inter_node_bytes"] == inter
            assert s["intra_node_bytes"] == 8 * math.ceil(numel / _lanes(local_size)) + 8 * math.ceil(
                chunk / _lanes(num_nodes))
    return results[0]["stats"][0]


def test_flat_gloo_np2():
    """With chunks of 496 elements (3 sums in flight together), equal to one sum in the simulation."""
    results = run_function(_worker, np=2, kwargs={"inter_node": "auto", "chunk_elements": 200}, timeout=120)
    s = _check(results, 2, 2, "auto")
    bits_per_element = 32 * s["inter_node_bytes"] / s["uncompressed_bytes"]
    assert bits_per_element == 32 * 3 * 16 * 8 / (4 * 1016)  # 3 chunks of one block of 16 words: ~3.02


def test_hierarchical_gloo_two_nodes():
    results = run_function(_worker, np=4, hosts="localhost:2,127.0.0.1:2", kwargs={"inter_node": "auto"},
                           init_kwargs={"process_sets": "dynamic"}, timeout=180)
    s = _check(results, 4, 2, "auto")
    assert s["route"] == "hierarchical:allgather"
    assert 32 * s["inter_node_bytes"] / s["uncompressed_bytes"] == pytest.approx(0.5, rel=0.01)  # 1 bit per node


def _open_route_worker(steps, faster_hierarchical):
    """``hierarchical=None``: the route trial's steps (one skipped for a NaN on rank 1), its verdict (the trial's
    steps timed 1 s on the ``faster_hierarchical`` route, 2 s on the other), and after."""
    import warnings

    import horovod.torch as hvd
    from horovod.torch import mpi_ops

    from hvdcomp.exchange.route import RouteTrial

    record = RouteTrial.record
    RouteTrial.record = lambda trial, seconds: record(trial, 1.0 if trial.second == faster_hierarchical else 2.0)
    params = _params()
    optimizer = Birder(params, **{**OPTIONS, "hierarchical": None})
    routes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the NaN step's
        for step in range(steps):
            _set_grads(params, hvd.rank(), step)
            optimizer.step()
            routes.append(None if step == NAN_STEP else optimizer.route.value)
    hvd.barrier()
    trial = optimizer.route_trial
    return {"params": [p.detach() for p in params], "routes": routes,
            "trial": None if trial is None else (trial.choice, trial.medians),
            "process_sets": sorted(mpi_ops._basics._get_process_set_ids_and_ranks().values())}  # Horovod's table


@pytest.mark.parametrize("dynamic_sets,faster_hierarchical", [(True, False), (True, True), (False, True)])
def test_route_left_open_gloo_two_nodes(dynamic_sets, faster_hierarchical):
    """2 emulated nodes x 2: flat steps, then hierarchical ones, then every worker on the same verdict, replicas
    equal; a flat verdict removes the node-local and cross-node process sets (Horovod coordinates each at every
    cycle). Without dynamic process sets (no node-local collectives over Horovod) only the flat route, untried."""
    rounds = TRIAL_ROUNDS
    steps = 2 * (rounds + 1) + 4  # the trial, one skipped step, three after the verdict
    results = run_function(_open_route_worker, np=4, hosts="localhost:2,127.0.0.1:2",
                           kwargs={"steps": steps, "faster_hierarchical": faster_hierarchical},
                           init_kwargs={"process_sets": "dynamic"} if dynamic_sets else None, timeout=180)
    for r in results:
        for a, b in zip(r["params"], results[0]["params"]):
            assert torch.equal(a, b)
        assert r["trial"] == results[0]["trial"] and r["routes"] == results[0]["routes"]
    routes = [route for route in results[0]["routes"] if route is not None]
    sets = results[0]["process_sets"]
    if not dynamic_sets:
        assert results[0]["trial"] is None and set(routes) == {"world:sum"} and sets == [[0, 1, 2, 3]]
        return
    assert results[0]["trial"] == (faster_hierarchical, (2.0, 1.0) if faster_hierarchical else (1.0, 2.0))
    assert routes[:2 * (rounds + 1)] == ["world:sum"] * (rounds + 1) + ["hierarchical:allgather"] * (rounds + 1)
    assert set(routes[2 * (rounds + 1):]) == {"hierarchical:allgather" if faster_hierarchical else "world:sum"}
    assert sets == ([[0, 1], [0, 1, 2, 3], [0, 2], [1, 3], [2, 3]] if faster_hierarchical else [[0, 1, 2, 3]])


@pytest.mark.mpi
def test_hierarchical_mpi_lane_sum():
    pytest.importorskip("mpi4py")
    results = run_function(_worker, np=4, launcher="mpi", kwargs={"inter_node": "sum", "mpi_local_size": 2},
                           timeout=180)
    s = _check(results, 4, 2, "sum")
    # 2-bit lanes (31 per 64-bit word) for half the elements: ~1.03 bits/element, plus the last word's padding
    assert s["inter_node_bytes"] * 8 / (s["uncompressed_bytes"] / 4) == pytest.approx(64 / 31 / 2, rel=0.05)
