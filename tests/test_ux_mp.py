"""Horovod's settings and workflows in real workers: hierarchical from HOROVOD_HIERARCHICAL_ALLREDUCE with
``hvdcomp.init()``, uncompressed warm-up, resuming at another world size, elastic training."""

import pytest
import torch

from tests.harness import run_elastic, run_function

EMULATED_NODES = "localhost:2,127.0.0.1:2"
TIMEOUT = 240


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _step(model, optimizer, rank, step):
    """One training step on this worker's batch ``step``; returns the loss."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 12, generator=gen)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), x @ torch.linspace(-0.3, 0.3, 12).unsqueeze(1))
    loss.backward()
    optimizer.step()
    return loss.item()


# --------------------------------------------------------------------------------------------------
# 1. hierarchical=None follows HOROVOD_HIERARCHICAL_ALLREDUCE (what horovodrun --hierarchical-allreduce sets)
# --------------------------------------------------------------------------------------------------


def _hierarchy_from_setting_worker():
    import warnings

    import horovod.torch as hvd

    import hvdcomp

    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for label, keyword in (("setting", {}), ("explicit_false", {"hierarchical": False})):
            model = _model()
            sgd = torch.optim.SGD(model.parameters(), lr=0.1)
            with hvdcomp.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                              compression=hvdcomp.QSGDMaxNorm(4), **keyword) as optimizer:
                _step(model, optimizer, hvd.rank(), 0)
                last = optimizer.stats.last_step
                out[label] = (last.intra_node_bytes, last.inter_node_bytes, last.uncompressed_bytes)
            birder_model = torch.nn.Linear(12, 1)
            birder = hvdcomp.Birder(birder_model.parameters(), lr=0.01, **keyword)
            birder_model(torch.randn(4, 12)).sum().backward()
            birder.step()
            out[f"birder_{label}"] = birder.route
    out["warnings"] = [str(w.message) for w in caught if "HIERARCH" in str(w.message).upper()]
    return out


@pytest.mark.slow
def test_hierarchical_follows_horovod_setting_on_two_nodes():
    results = run_function(_hierarchy_from_setting_worker, np=4, hosts=EMULATED_NODES, init="hvdcomp",
                           env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}, timeout=TIMEOUT)
    for rank, out in enumerate(results):
        intra, inter, uncompressed = out["setting"]
        flat_intra, flat_inter, _ = out["explicit_false"]
        assert intra > 0 and flat_intra == 0, (rank, out)
        assert inter < flat_inter / 1.5 and inter < uncompressed, (rank, out)  # each worker sends 1/2 across
        assert out["birder_setting"].startswith("hierarchical:") and out["birder_explicit_false"] == "world:sum"
        assert out["warnings"] == [], out["warnings"]  # no more "takes effect only on NCCL builds"


def _hierarchical_without_dynamic_sets_worker():
    import hvdcomp

    model = _model()
    try:
        hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    except RuntimeError as error:
        return str(error)
    return "built"


@pytest.mark.slow
def test_hierarchical_setting_with_plain_hvd_init_names_the_fix():
    results = run_function(_hierarchical_without_dynamic_sets_worker, np=2,
                           env={"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}, timeout=TIMEOUT)
    for message in results:
        assert "hvdcomp.init()" in message and "hierarchical=False" in message, message


# --------------------------------------------------------------------------------------------------
# 2. warm-up: the first N steps equal NoCompression exactly, the codec untouched; then compressed
# --------------------------------------------------------------------------------------------------

WARMUP = 2


def _warmup_worker():
    import horovod.torch as hvd

    import hvdcomp

    def run(make, compressor=None, steps=WARMUP + 2):
        """Parameters, compression ratio and codec state (its repr, and the stock step counts) after each step."""
        model = _model()
        optimizer = make(model)
        codec = compressor.inner if isinstance(compressor, hvdcomp.MaxNormCompressor) else compressor
        stats = getattr(optimizer, "stats", getattr(compressor, "stats", None))
        params, ratios, codec_states = [], [], []
        for step in range(steps):
            _step(model, optimizer, hvd.rank(), step)
            params.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
            last = stats.last_step if stats is not None else None
            ratios.append(None if last is None else last.uncompressed_bytes / last.inter_node_bytes)
            stock = (compressor.stock().state_dict()["steps"] if isinstance(compressor, hvdcomp.MaxNormCompressor)
                     else {})
            codec_states.append(None if codec is None else (repr(codec.state_dict()), stock))
        if hasattr(optimizer, "close"):
            optimizer.close()
        return params, ratios, codec_states

    def ours(**kwargs):
        return lambda model: hvdcomp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), named_parameters=model.named_parameters(),
            bucket_size_mb=0.001, **kwargs)

    def stock(compression):
        return lambda model: hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), named_parameters=model.named_parameters(),
            compression=compression)

    out = {"none": run(ours(compression=hvdcomp.NoCompression())), "stock_none": run(stock(hvd.Compression.none))}
    randk = hvdcomp.GlobalRandKMaxNorm(ratio=0.3, bits=4)
    out["randk_keyword"] = run(ours(compression=randk, warmup_steps=WARMUP), randk)
    randk = hvdcomp.GlobalRandKMaxNorm(ratio=0.3, bits=4, warmup_steps=WARMUP)  # the compressor's own setting
    out["randk_compressor"] = run(ours(compression=randk), randk)
    powersgd = hvdcomp.PowerSGD(rank=1, min_compression_rate=1.0)
    out["powersgd"] = run(ours(compression=powersgd, warmup_steps=WARMUP), powersgd)
    for label, compressor in (
            ("stock_randk", hvdcomp.GlobalRandKMaxNorm(ratio=0.3, bits=4, warmup_steps=WARMUP, min_compress_numel=0)),
            ("stock_qsgd", hvdcomp.QSGDMaxNorm(2, warmup_steps=WARMUP, min_compress_numel=0))):
        out[label] = run(stock(compressor), compressor)
    return out


@pytest.mark.slow
def test_warmup_steps_are_exact_then_compressed():
    results = run_function(_warmup_worker, np=2, timeout=TIMEOUT)
    for rank, out in enumerate(results):
        for label, reference in (("randk_keyword", "none"), ("randk_compressor", "none"), ("powersgd", "none"),
                                 ("stock_randk", "stock_none"), ("stock_qsgd", "stock_none")):
            params, ratios, codec_states = out[label]
            expected = out[reference][0]
            for step in range(WARMUP):
                assert torch.equal(params[step], expected[step]), (rank, label, step)
                assert ratios[step] == pytest.approx(1.0, abs=0.05), (rank, label, ratios)
                assert codec_states[step] == codec_states[0], (rank, label, step)  # untouched
            assert not torch.equal(params[WARMUP], expected[WARMUP]), (rank, label)
            assert ratios[WARMUP] > 1.5 and ratios[-1] > 1.5, (rank, label, ratios)
            assert codec_states[WARMUP] != codec_states[0], (rank, label)


# --------------------------------------------------------------------------------------------------
# 3. resume at another world size: saved by 2 workers, loaded into 3
# --------------------------------------------------------------------------------------------------


def _optimizers(**birder_options):
    """A model with hvdcomp's optimizer (error-feedback memory, SGD momentum) and one with Birder."""
    import hvdcomp

    model, birder_model = _model(), _model()
    optimizer = hvdcomp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5), named_parameters=model.named_parameters(),
        compression=hvdcomp.GlobalRandKMaxNorm(ratio=0.3, bits=4), bucket_size_mb=0.001)
    return model, optimizer, birder_model, hvdcomp.Birder(birder_model.parameters(), lr=0.01, **birder_options)


def _save_worker(path, steps):
    import horovod.torch as hvd

    model, optimizer, birder_model, birder = _optimizers()
    for step in range(steps):
        _step(model, optimizer, hvd.rank(), step)
        _step(birder_model, birder, hvd.rank(), step)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "birder_model": birder_model.state_dict(), "birder": birder.state_dict()}, f"{path}.rank{hvd.rank()}")


def _resume_elsewhere_worker(path, saved_size, first_step):
    import warnings

    import horovod.torch as hvd

    model, optimizer, birder_model, birder = _optimizers()
    state = torch.load(f"{path}.rank{hvd.rank() % saved_size}", weights_only=True)  # any worker's checkpoint
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        birder_model.load_state_dict(state["birder_model"])
        birder.load_state_dict(state["birder"])
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    saved_momentum = list(state["optimizer"]["state"][i]["momentum_buffer"] for i in range(len(momentum)))
    kept = {"momentum": all(torch.equal(a, b) for a, b in zip(momentum, saved_momentum)),
            "exchange_step": optimizer._state.step == state["optimizer"]["hvdcomp"]["exchange_step"],
            "memory_reset": optimizer._state.codec.memory.state_dict()["residuals"] == {},
            "birder_m": torch.equal(birder._m, state["birder"]["birder"]["m"]), "birder_step": birder._step}
    losses = [(_step(model, optimizer, hvd.rank(), step), _step(birder_model, birder, hvd.rank(), step))
              for step in range(first_step, first_step + 6)]
    params = torch.cat([p.detach().reshape(-1) for p in [*model.parameters(), *birder_model.parameters()]])
    return {"warnings": [str(w.message) for w in caught], "kept": kept, "losses": losses, "params": params}


@pytest.mark.slow
def test_resume_at_another_world_size(tmp_path):
    path = str(tmp_path / "checkpoint")
    run_function(_save_worker, np=2, kwargs={"path": path, "steps": 3}, timeout=TIMEOUT)
    results = run_function(_resume_elsewhere_worker, np=3, kwargs={"path": path, "saved_size": 2, "first_step": 3},
                           timeout=TIMEOUT)
    for rank, out in enumerate(results):
        assert out["kept"] == {"momentum": True, "exchange_step": True, "memory_reset": True, "birder_m": True,
                               "birder_step": 3}, (rank, out["kept"])
        messages = out["warnings"]
        assert len(messages) == 2, (rank, messages)  # one per optimizer, nothing about "another rank's state"
        assert all("saved by 2 workers" in m and "loaded into 3" in m for m in messages), (rank, messages)
        assert torch.equal(out["params"], results[0]["params"]), rank  # the replicas stay identical
        assert bool(torch.isfinite(torch.tensor(out["losses"])).all()), out["losses"]


# --------------------------------------------------------------------------------------------------
# 4. Horovod elastic: 3 workers, one dies, training goes on with 2
# --------------------------------------------------------------------------------------------------

ELASTIC_STEPS, KILL_AT = 14, 5


def _elastic_worker(marker):
    """Both optimizers under one TorchState; the worker on 127.0.0.1 dies at step KILL_AT after telling
    the discovery script to drop its host. Returns the world sizes and mean losses of every step."""
    import os

    import horovod.torch as hvd

    model, optimizer, birder_model, birder = _optimizers(hierarchical=False)  # the nodes are 2 + 1 workers
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, birder_model=birder_model, birder=birder,
                                   step=0, sizes=[], losses=[])

    @hvd.elastic.run
    def train(state):
        while state.step < ELASTIC_STEPS:
            if state.step == KILL_AT and hvd.size() == 3 and os.environ.get("HOROVOD_HOSTNAME") == "127.0.0.1":
                with open(marker, "w") as f:
                    f.write("gone")
                os._exit(1)
            losses = [_step(model, optimizer, hvd.rank(), state.step), _step(birder_model, birder, hvd.rank(),
                                                                              state.step)]
            mean = hvd.allreduce(torch.tensor(losses), name=f"loss.{state.step}").tolist()
            state.sizes.append(hvd.size())
            state.losses.append(mean)
            state.step += 1
            state.commit()

    train(state)
    params = torch.cat([p.detach().reshape(-1) for p in [*model.parameters(), *birder_model.parameters()]])
    return {"sizes": state.sizes, "losses": state.losses, "params": params}


@pytest.mark.slow
def test_elastic_three_workers_to_two(tmp_path):
    marker = tmp_path / "gone"
    discovery = f'echo localhost:2\nif [ ! -e "{marker}" ]; then echo 127.0.0.1:1; fi\n'
    results, output = run_elastic(_elastic_worker, np=3, min_np=2, discovery_script=discovery,
                                  kwargs={"marker": str(marker)}, timeout=2 * TIMEOUT)
    assert len(results) == 2, output
    for out in results:
        assert out["sizes"][:KILL_AT] == [3] * KILL_AT and out["sizes"][KILL_AT:] == [2] * (ELASTIC_STEPS - KILL_AT)
        assert torch.equal(out["params"], results[0]["params"])  # the replicas stay identical
        losses = torch.tensor(out["losses"])  # [step, optimizer]
        assert bool((losses[-3:].mean(0) < losses[:3].mean(0)).all()), out["losses"]  # still learning
        assert bool((losses[KILL_AT + 3:].mean(0) < losses[KILL_AT:KILL_AT + 3].mean(0)).all()), out["losses"]
    assert output.count("workers changed (elastic)") >= 1, output
