"""hvdcomp.DistributedOptimizer in real Horovod (and MPI) workers."""

import pytest
import torch

from tests.harness import run_function

EMULATED_NODES = "localhost:2,127.0.0.1:2"
SCHEMES = ["none", "horovod_none", "fp16", "fp16_ef", "qsgd8", "qsgd4_chunked", "qsgd4_rotated", "multiscale", "randk",
           "powersgd1", "powersgd2"]


def _codec(name):
    import horovod.torch as hvd

    import hvdcomp
    from hvdcomp import FP16, PowerSGD

    return {
        "none": lambda: None,
        "horovod_none": lambda: hvd.Compression.none,
        "fp16": lambda: hvd.Compression.fp16,
        "fp16_ef": lambda: FP16(error_feedback=True),
        "qsgd8": lambda: hvdcomp.QSGDMaxNorm(8),
        "qsgd4_chunked": lambda: hvdcomp.QSGDMaxNorm(4, chunk_size=64),
        "qsgd4_rotated": lambda: hvdcomp.QSGDMaxNorm(4, rotate=True),
        "multiscale": lambda: hvdcomp.QSGDMaxNormMultiScale((3, 8)),
        "randk": lambda: hvdcomp.GlobalRandKMaxNorm(ratio=0.5, bits=6),
        "powersgd1": lambda: PowerSGD(rank=1, min_compression_rate=1.0),
        "powersgd2": lambda: PowerSGD(rank=2, min_compression_rate=1.0),
    }[name]()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 1))


def _batches(rank, steps, seed=0):
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    teacher = torch.linspace(-1, 1, 12)
    for _ in range(steps):
        x = torch.randn(32, 12, generator=gen)
        yield x, torch.sin(x @ teacher).unsqueeze(1)


def _train(make_optimizer, steps, state=None, first_step=0):
    """Train the test model; returns (losses, params, optimizer)."""
    import horovod.torch as hvd

    model = _model()
    optimizer = make_optimizer(model)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    losses = []
    batches = list(_batches(hvd.rank(), first_step + steps))[first_step:]
    for x, y in batches:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()], optimizer, model


def _ours(name, **kwargs):
    from hvdcomp import DistributedOptimizer

    def make(model):
        sgd = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
        return DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=_codec(name),
                                    bucket_size_mb=0.004, **kwargs)

    return make


def _flat_worker(names, steps, hierarchical_too=False):
    out = {}
    for name in names:
        for hierarchical in ([False, True] if hierarchical_too else [False]):
            losses, params, optimizer, _ = _train(_ours(name, hierarchical=hierarchical), steps)
            out[(name, hierarchical)] = {"losses": losses, "params": params, "stats": optimizer.stats.total.as_dict(),
                                         "buckets": len(optimizer._state.plan)}
    return out


def _horovod_reference_worker(steps):
    import horovod.torch as hvd

    def make(model):
        sgd = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
        return hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())

    losses, params, _, _ = _train(make, steps)
    return {"losses": losses, "params": params}


def _assert_replicas_identical(results, key):
    for other in results[1:]:
        for a, b in zip(results[0][key]["params"], other[key]["params"]):
            assert torch.equal(a, b), key


def _final_loss(results, key):
    return sum(sum(r[key]["losses"][-5:]) / 5 for r in results) / len(results)


def test_uncompressed_matches_horovod_and_every_scheme_trains_np2():
    steps = 40
    ours = run_function(_flat_worker, np=2, kwargs={"names": SCHEMES, "steps": steps}, timeout=300)
    reference = run_function(_horovod_reference_worker, np=2, kwargs={"steps": steps})
    for rank in range(2):
        for a, b in zip(ours[rank][("none", False)]["params"], reference[rank]["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    baseline = _final_loss(ours, ("none", False))
    first = sum(r[("none", False)]["losses"][0] for r in ours) / 2
    assert baseline < 0.7 * first
    for name in SCHEMES:
        key = (name, False)
        _assert_replicas_identical(ours, key)
        assert _final_loss(ours, key) < 1.5 * baseline + 0.05, (name, _final_loss(ours, key), baseline)
        stats = ours[0][key]["stats"]
        assert stats["intra_node_bytes"] == 0 and stats["inter_node_bytes"] > 0
        assert stats["compress_s"] >= 0 and stats["communicate_s"] > 0
    ratios = {name: ours[0][(name, False)]["stats"]["compression_ratio"] for name in SCHEMES}
    assert ratios["none"] == 1.0
    # float16 by all-to-all + all-gather: 16 bits per element, plus the padding of odd buckets to a multiple of W
    assert ratios["fp16"] == ratios["fp16_ef"] and 1.99 < ratios["fp16"] <= 2.0
    assert 2.5 < ratios["qsgd8"] < 3.0  # 10.67 bits per element at W = 2, plus a few scales
    assert ratios["qsgd4_chunked"] > ratios["qsgd8"] and ratios["randk"] > 1.8 * ratios["qsgd8"]
    assert ratios["powersgd1"] > ratios["powersgd2"] > 2


def _statistics_rows_worker(steps):
    """The same training twice, QSGD 8 on a 33K-parameter layer: its statistics in the payload's rows, then (a
    share no payload meets) in a MAX of their own. Returns each run's parameters and its rows per exchange."""
    import horovod.torch as hvd

    import hvdcomp

    out = []
    for share in (None, 10**18):
        torch.manual_seed(0)
        model = torch.nn.Linear(128, 256)
        optimizer = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                 named_parameters=model.named_parameters(),
                                                 compression=hvdcomp.QSGDMaxNorm(8))
        codec, rows = optimizer._state.codec, []
        if share is not None:
            codec.scale_share = share
        choose = codec.scale_rows
        codec.scale_rows = lambda *args, rows=rows, choose=choose: rows.append(choose(*args)) or rows[-1]
        for x, y in _batches(hvd.rank(), steps):
            optimizer.zero_grad()
            loss = (model(torch.nn.functional.pad(x, (0, 116))) - y).square().mean()
            loss.backward()
            optimizer.step()
        out.append({"params": [p.detach().clone() for p in model.parameters()], "rows": rows})
    return out


def test_statistics_in_the_payload_train_exactly_as_with_a_max_np2():
    results = run_function(_statistics_rows_worker, np=2, kwargs={"steps": 6})
    for riding, separate in results:
        assert riding["rows"] and all(rows > 0 for rows in riding["rows"])
        assert separate["rows"] and not any(separate["rows"])
        assert all(torch.equal(a, b) for a, b in zip(riding["params"], separate["params"]))
    assert all(torch.equal(a, b) for a, b in zip(results[0][0]["params"], results[1][0]["params"]))


def test_two_emulated_nodes_flat_and_hierarchical():
    names = ["none", "qsgd8", "qsgd4_rotated", "multiscale", "randk", "fp16", "powersgd2"]
    results = run_function(_flat_worker, np=4, hosts=EMULATED_NODES, init_kwargs={"process_sets": "dynamic"},
                           kwargs={"names": names, "steps": 8, "hierarchical_too": True}, timeout=400)
    baseline = _final_loss(results, ("none", False))
    for name in names:
        flat, hier = (name, False), (name, True)
        _assert_replicas_identical(results, flat)
        _assert_replicas_identical(results, hier)
        assert _final_loss(results, hier) < 1.5 * baseline + 0.05, name
        # hierarchical: full precision inside the node, each local rank carries a shard across nodes
        def node_bytes(key, kind):
            return results[0][key]["stats"][kind] + results[1][key]["stats"][kind]

        assert node_bytes(flat, "intra_node_bytes") == 0 and node_bytes(hier, "intra_node_bytes") > 0
        assert node_bytes(hier, "inter_node_bytes") < 0.75 * node_bytes(flat, "inter_node_bytes"), name
    # uncompressed: flat and hierarchical compute the same average (up to float summation order)
    for a, b in zip(results[0][("none", False)]["params"], results[0][("none", True)]["params"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _one_step_means_worker(names, launcher_mpi):
    """The averaged gradient of one step, flat and hierarchical, per scheme, plus the exact mean."""
    import horovod.torch as hvd

    from hvdcomp import DistributedOptimizer, MPITransport

    transport = MPITransport(local_size=2) if launcher_mpi else None
    out = {}
    x, y = next(_batches(hvd.rank(), 1))
    for name in ["none", *names]:
        for hierarchical in (False, True):
            model = _model()
            optimizer = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), compression=_codec(name),
                                             hierarchical=hierarchical, transport=transport)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.synchronize()
            out[(name, hierarchical)] = {
                "grads": torch.cat([p.grad.reshape(-1) for p in model.parameters()]),
                "stats": optimizer.stats.last_step.as_dict(),
            }
    return out


@pytest.mark.mpi
def test_hierarchical_over_mpi_gives_the_flat_average():
    names = ["qsgd8", "randk", "powersgd2"]
    results = run_function(_one_step_means_worker, np=4, launcher="mpi", timeout=300,
                           kwargs={"names": names, "launcher_mpi": True})
    exact = results[0][("none", False)]["grads"]
    torch.testing.assert_close(results[0][("none", True)]["grads"], exact, rtol=1e-5, atol=1e-6)
    for name in names:
        for hierarchical in (False, True):
            grads = [r[(name, hierarchical)]["grads"] for r in results]
            assert all(torch.equal(grads[0], g) for g in grads[1:]), (name, hierarchical)
        flat, hier = results[0][(name, False)], results[0][(name, True)]
        if name == "qsgd8":  # unbiased 8-bit quantization: both within a few coarse units of the exact mean
            unit = exact.abs().max() * 2 / 255
            assert (flat["grads"] - exact).abs().max() < unit and (hier["grads"] - exact).abs().max() < unit
        node = [r[(name, h)]["stats"]["inter_node_bytes"] for h in (False, True) for r in results[:2]]
        assert node[2] + node[3] < 0.75 * (node[0] + node[1]), name


def _resume_worker(name, path, phase):
    """phase 'save': unbroken 2k steps, and k steps saved to ``path``; phase 'load': k more from ``path``."""
    import horovod.torch as hvd

    k = 6
    if phase == "save":
        unbroken = _train(_ours(name), 2 * k)[1]
        _, _, optimizer, model = _train(_ours(name), k)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f"{path}.{hvd.rank()}")
        return unbroken
    state = torch.load(f"{path}.{hvd.rank()}", weights_only=True)
    return _train(_ours(name), k, state=state, first_step=k)[1]


@pytest.mark.parametrize("name", ["randk", "powersgd1", "fp16_ef"])
def test_resume_continues_exactly(tmp_path, name):
    path = str(tmp_path / "checkpoint")
    unbroken = run_function(_resume_worker, np=2, kwargs={"name": name, "path": path, "phase": "save"})
    resumed = run_function(_resume_worker, np=2, kwargs={"name": name, "path": path, "phase": "load"})
    for rank in range(2):
        for a, b in zip(unbroken[rank], resumed[rank]):
            assert torch.equal(a, b), name


def _misuse_worker():
    import warnings

    import horovod.torch as hvd

    from hvdcomp import Birder, DistributedOptimizer

    errors = {}

    def attempt(label, fn):
        try:
            fn()
        except (ValueError, TypeError, AssertionError) as error:
            errors[label] = f"{type(error).__name__}: {error}"

    model = _model()
    other = torch.nn.Linear(2, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    named = list(model.named_parameters())
    attempt("duplicate names", lambda: DistributedOptimizer(sgd, named_parameters=[named[0], named[0]] + named[1:]))
    attempt("unnamed", lambda: DistributedOptimizer(sgd, named_parameters=named[:2]))
    # names of parameters the optimizer does not hold (e.g. a frozen layer) are accepted, as by Horovod
    DistributedOptimizer(sgd, named_parameters=named + [("x", other.weight)]).close()
    attempt("not tuples", lambda: DistributedOptimizer(sgd, named_parameters=[p for _, p in named]))
    attempt("passes", lambda: DistributedOptimizer(sgd, backward_passes_per_step=0))
    attempt("adasum", lambda: DistributedOptimizer(sgd, op=hvd.Adasum))
    attempt("compression", lambda: DistributedOptimizer(sgd, compression="zip"))
    attempt("birder", lambda: DistributedOptimizer(Birder(model.parameters(), lr=0.1)))
    lonely = hvd.add_process_set([0])
    spare = torch.nn.Linear(2, 2)
    outside = DistributedOptimizer(torch.optim.SGD(spare.parameters(), lr=0.1), process_set=lonely)
    errors["outside hooks"] = len(outside._hooks)  # rank 1 is outside the set: a local optimizer, as in Horovod

    optimizer = DistributedOptimizer(sgd, named_parameters=named)
    torch.nn.functional.mse_loss(model(torch.randn(4, 12)), torch.zeros(4, 1)).backward()
    attempt("zero_grad early", optimizer.zero_grad)
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with optimizer.skip_synchronize():
            optimizer.step()  # after synchronize(): no second exchange, no warning
        torch.nn.functional.mse_loss(model(torch.randn(4, 12)), torch.zeros(4, 1)).backward()
        optimizer.synchronize()
        optimizer.step()  # forgot skip_synchronize(): warns like Horovod, and exchanges again like Horovod
    errors["warnings"] = [str(w.message) for w in caught]
    errors["exchanges"] = optimizer.stats.steps
    optimizer.zero_grad()
    half = model.half()
    attempt("mixed dtypes", lambda: half(torch.randn(4, 12).half()).sum().backward())
    return errors


def test_misuse_is_refused_clearly():
    results = run_function(_misuse_worker, np=2, init_kwargs={"process_sets": "dynamic"})
    rank0, rank1 = results
    for label in ["duplicate names", "unnamed", "not tuples", "passes", "adasum", "compression",
                  "birder", "zero_grad early", "mixed dtypes"]:
        assert label in rank0, label
    assert rank0["outside hooks"] == 2 and rank1["outside hooks"] == 0
    assert "unique" in rank0["duplicate names"] and "backward_passes_per_step" in rank0["passes"]
    assert "zero_grad" in rank0["zero_grad early"]
    messages = rank0["warnings"]
    assert len(messages) == 1 and "skip_synchronize" in messages[0], messages
    assert rank0["exchanges"] == 3
