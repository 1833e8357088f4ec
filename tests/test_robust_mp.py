"""Horovod parity and robustness of every Horovod door, with real Horovod workers (``tests/harness.py``).

Grouped by behaviour: parameters used on some ranks only, frozen, sparse or grouped; the stock optimizer's
pairing of gradients by name; several optimizers in one backward; ``step()`` after ``synchronize()``;
``broadcast_optimizer_state`` and checkpoints; process sets; ``close()``; failures on one rank; Birder on
uneven nodes and without gradients. Only the public API is used (``import hvdcomp`` and ``horovod.torch``).
Each launch has its own timeout, so a hang shows as a failure instead of a stuck suite.
"""

import inspect
import re
import subprocess
import sys

import pytest
import torch

from tests.harness import run_function

pytestmark = pytest.mark.slow

EMULATED_NODES = "localhost:2,127.0.0.1:2"  # 2 nodes x 2 workers under Gloo (needs dynamic process sets)
UNEVEN_NODES = "localhost:2,127.0.0.1:1"  # 3 workers as 2 + 1
DYNAMIC = {"process_sets": "dynamic"}
TIMEOUT = 90  # a hang shows as "timed out", not as a stuck suite (generous: the machine may be shared)
TINY_BUCKETS = 1e-6  # one parameter per bucket, so buckets launch in different orders on different ranks

HOROVOD_STEP_WARNING = (
    "optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize(). "
    "This can cause training slowdown. You may want to consider using optimizer.skip_synchronize() context "
    "if you use optimizer.synchronize() in your code."
)


# --------------------------------------------------------------------------------------------------
# helpers (shipped to the workers by value)
# --------------------------------------------------------------------------------------------------


def _codec(name):
    import horovod.torch as hvd

    import hvdcomp

    return {
        None: lambda: None,
        "none": lambda: None,
        # the exact scale: these tests bound each step's error (scale="ahead" delays a clipped excess a step;
        # tests/test_ahead.py and tests/test_optimizer_mp.py cover it)
        "qsgd8": lambda: hvdcomp.QSGDMaxNorm(8, scale="exact", min_compress_numel=0),
        "qsgd8_ahead": lambda: hvdcomp.QSGDMaxNorm(8, min_compress_numel=0),
        "multiscale": lambda: hvdcomp.QSGDMaxNormMultiScale((3, 8), min_compress_numel=0),
        # rank 8 >= min(n, m) for every matrix here: the low-rank approximation is exact
        "powersgd": lambda: hvdcomp.PowerSGD(rank=8, min_compression_rate=0.0),
        "fp16": lambda: hvdcomp.FP16(),
        "fp16_ef": lambda: hvdcomp.FP16(error_feedback=True),
        "horovod_fp16": lambda: hvd.Compression.fp16,
    }[name]()


# Largest error of one averaged element, as a fraction of the tensor's largest |gradient| on any rank.
_TOLERANCE = {"none": 1e-6, "qsgd8": 1.01 / 255, "multiscale": 1.01 / 7, "powersgd": 1e-3, "fp16": 2e-3,
              "fp16_ef": 2e-3, "horovod_fp16": 2e-3}


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch(rank, step, rows=4):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, 6, generator=gen), torch.randn(rows, 3, generator=gen)


def _mlp_loss(model, rank, step):
    x, y = _batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _local_grads(loss, params):
    """This rank's own gradients of ``loss`` (zeros where unused), taken apart from ``.grad``: the optimizer's
    hooks may already have replaced ``.grad`` with the mean by the time ``backward()`` returns."""
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach().clone() for p, g in zip(params, grads)]


def _exact_mean_and_peak(local):
    """Uncompressed mean over all ranks of each tensor in ``local``, and each tensor's max |value| over ranks."""
    import horovod.torch as hvd

    flat = torch.cat([g.reshape(-1) for g in local])
    gathered = hvd.allgather(flat.unsqueeze(0), name="robust.exact").double()  # [size, numel]
    mean = gathered.mean(0).float()
    means, peaks, offset = [], [], 0
    for g in local:
        means.append(mean[offset:offset + g.numel()].view_as(g))
        peaks.append(float(gathered[:, offset:offset + g.numel()].abs().max()) if g.numel() else 0.0)
        offset += g.numel()
    return means, peaks


def _step_error(optimizer, loss, params):
    """Backward, synchronize and step; returns the worst error of the exchanged gradients against the exact
    mean of the ranks' own gradients, as a fraction of each tensor's peak |gradient| over the ranks."""
    local = _local_grads(loss, params)
    loss.backward()
    optimizer.synchronize()
    means, peaks = _exact_mean_and_peak(local)
    error = max(float((p.grad - m).abs().max()) / max(peak, 1e-12) for p, m, peak in zip(params, means, peaks))
    with optimizer.skip_synchronize():
        optimizer.step()
    return error


def _train(model, optimizer, steps, first_step=0):
    import horovod.torch as hvd

    for step in range(first_step, first_step + steps):
        optimizer.zero_grad()
        _mlp_loss(model, hvd.rank(), step).backward()
        optimizer.step()


def _assert_replicas_identical(results, key):
    for rank, other in enumerate(results[1:], start=1):
        for a, b in zip(results[0][key], other[key]):
            assert torch.equal(a, b), f"{key}: rank {rank} differs from rank 0"


def _per_codec(worker, codecs, **kwargs):
    """``worker(codec, **kwargs)`` for each of ``codecs`` in one launch (one horovodrun for several
    compressors): {codec: its result}."""
    return {codec: worker(codec, **kwargs) for codec in codecs}


def _rank_tracebacks(message):
    """{rank: traceback text} from a harness failure message."""
    body = message.split("----- launcher output")[0]
    parts = re.split(r"----- rank (-?\d+) traceback -----\n", body)
    return {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


# --------------------------------------------------------------------------------------------------
# a parameter used on one rank only (data-dependent branch), multi-round codecs
# --------------------------------------------------------------------------------------------------


def _branch_model():
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"trunk": torch.nn.Linear(6, 8), "a": torch.nn.Linear(8, 8),
                                "b": torch.nn.Linear(8, 8), "out": torch.nn.Linear(8, 3)})


def _branch_worker(codec, steps=3, hierarchical=False, mpi=False):
    """Rank 0 takes branch ``a``, every other rank branch ``b``: each branch's parameters get a gradient on
    some ranks only. Returns the parameters and, per step, the worst error of the exchanged gradients
    against the exact mean (as a fraction of each tensor's peak |gradient|)."""
    import horovod.torch as hvd

    import hvdcomp

    model = _branch_model()
    params = list(model.parameters())
    extra = {"transport": hvdcomp.MPITransport()} if mpi else {}
    optimizer = hvdcomp.DistributedOptimizer(
        torch.optim.SGD(params, lr=0.1), named_parameters=model.named_parameters(), compression=_codec(codec),
        bucket_size_mb=TINY_BUCKETS, hierarchical=hierarchical, **extra)
    branch = "a" if hvd.rank() == 0 else "b"
    errors = []
    for step in range(steps):
        optimizer.zero_grad()
        x, y = _batch(hvd.rank(), step)
        hidden = torch.tanh(model[branch](torch.tanh(model["trunk"](x))))
        errors.append(_step_error(optimizer, torch.nn.functional.mse_loss(model["out"](hidden), y), params))
    return {"params": _params(model), "errors": errors}


def _check_branch_results(results, codec):
    _assert_replicas_identical(results, "params")
    for rank, r in enumerate(results):
        assert max(r["errors"]) <= _TOLERANCE[codec], (rank, r["errors"])


def test_param_used_on_one_rank_only():
    codecs = ["qsgd8", "multiscale", "powersgd"]
    results = run_function(_per_codec, np=2, kwargs={"worker": _branch_worker, "codecs": codecs}, timeout=TIMEOUT)
    for codec in codecs:
        _check_branch_results([r[codec] for r in results], codec)


def test_param_used_on_one_rank_only_hierarchical():
    results = run_function(_branch_worker, np=4, hosts=EMULATED_NODES, init_kwargs=DYNAMIC,
                           kwargs={"codec": "qsgd8", "hierarchical": True}, timeout=TIMEOUT)
    _check_branch_results(results, "qsgd8")


@pytest.mark.mpi
def test_param_used_on_one_rank_only_mpi():
    pytest.importorskip("mpi4py")
    results = run_function(_branch_worker, np=2, launcher="mpi", kwargs={"codec": "qsgd8", "mpi": True},
                           timeout=TIMEOUT)
    _check_branch_results(results, "qsgd8")


# --------------------------------------------------------------------------------------------------
# stock hvd.DistributedOptimizer with hvdcomp compressors: pair by Horovod's tensor names
# --------------------------------------------------------------------------------------------------


def _heads_model():
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"trunk": torch.nn.Linear(6, 8), "h1": torch.nn.Linear(8, 4),
                                "h2": torch.nn.Linear(8, 4), "h3": torch.nn.Linear(8, 4)})


def _stock_heads_worker(codec, trials=6, steps=4):
    """Heads h1 and h2 are used alternately; the other one, and h3 always, is unused in a step, so Horovod
    zero-fills them and compresses them in ``synchronize()`` in set-iteration order, which follows the
    parameters' ids. Each trial builds the model after a rank- and trial-dependent number of allocations,
    so that order differs between the ranks, as between separate launches."""
    import horovod.torch as hvd

    keep = []
    trials_out = []
    for trial in range(trials):
        keep.append([torch.nn.Parameter(torch.zeros(1)) for _ in range(1 + 3 * trial + 7 * hvd.rank())])
        model = _heads_model()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(), compression=_codec(codec))
        for step in range(steps):
            optimizer.zero_grad()
            x, y = _batch(hvd.rank(), step)
            head = model["h1"] if step % 2 == 0 else model["h2"]
            torch.nn.functional.mse_loss(head(torch.tanh(model["trunk"](x))), y[:, :1].expand(-1, 4)).backward()
            optimizer.step()
        trials_out.append({"params": _params(model)})
    return trials_out


def test_stock_optimizer_pairs_unused_heads_by_name():
    """QSGD in the stock optimizer, two alternately used heads, unused parameters compressed in a different
    order on each rank: no CarrierMismatchError, replicas agree."""
    results = run_function(_stock_heads_worker, np=2, kwargs={"codec": "qsgd8_ahead"}, timeout=TIMEOUT)
    for trial in range(len(results[0])):
        _assert_replicas_identical([r[trial] for r in results], "params")


def _stock_error_feedback_worker(steps=4):
    """GlobalRandK (half the coordinates per step, error feedback, 16 bits) in the stock optimizer. Head h2
    is used in step 0 only, head h1 in the later steps: exactly one parameter is unused in each step, so the
    ranks always agree on the order, but the set of used parameters changes after step 0. h2's memory holds
    the half of its step-0 gradient not sent then; the next step's coordinates are the other half, so by the
    end h2 must have moved by exactly -lr times its mean step-0 gradient (up to 16-bit rounding)."""
    import horovod.torch as hvd

    import hvdcomp

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"trunk": torch.nn.Linear(6, 8), "h1": torch.nn.Linear(8, 4, bias=False),
                                 "h2": torch.nn.Linear(8, 4, bias=False)})
    start = model["h2"].weight.detach().clone()
    lr = 0.1
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=lr), named_parameters=model.named_parameters(),
        compression=hvdcomp.GlobalRandKMaxNorm(ratio=0.5, bits=16, error_feedback=True, min_compress_numel=0))
    for step in range(steps):
        optimizer.zero_grad()
        x, y = _batch(hvd.rank(), step)
        head = model["h2"] if step == 0 else model["h1"]
        loss = torch.nn.functional.mse_loss(head(torch.tanh(model["trunk"](x))), y[:, :1].expand(-1, 4))
        if step == 0:
            (means,), (peak,) = _exact_mean_and_peak(_local_grads(loss, [model["h2"].weight]))
        loss.backward()
        optimizer.step()
    return {"params": _params(model), "h2_moved": model["h2"].weight.detach() - start, "h2_expected": -lr * means,
            "tolerance": 1e-3 * lr * peak}


def test_stock_optimizer_error_feedback_follows_the_tensor():
    """With memories keyed by position, h2's residual goes to whichever tensor takes its position (h1) and
    h2 never gets the rest of its gradient: silent corruption, no error."""
    results = run_function(_stock_error_feedback_worker, np=2, timeout=TIMEOUT)
    _assert_replicas_identical(results, "params")
    for r in results:
        torch.testing.assert_close(r["h2_moved"], r["h2_expected"], rtol=0, atol=r["tolerance"])


def _stock_rank_dependent_heads_worker(codec, steps=4):
    """Horovod's force-allreduce pattern: every rank's loss uses the trunk and head ``p``; rank 1's also
    adds head ``q``. So during backward the hooks compress different gradients on the two ranks (rank 0
    compresses ``q`` only in ``synchronize()``, zero-filled). Uncompressed Horovod for reference."""
    import horovod.torch as hvd

    import hvdcomp

    out = {}
    compressions = {"none": lambda: hvd.Compression.none,
                    "qsgd8": lambda: hvdcomp.QSGDMaxNorm(8, scale="exact", min_compress_numel=0),
                    "qsgd8_ahead": lambda: hvdcomp.QSGDMaxNorm(8, min_compress_numel=0),
                    "randk05": lambda: hvdcomp.GlobalRandKMaxNorm(ratio=0.5, min_compress_numel=0)}
    for label in ("none", codec):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"trunk": torch.nn.Linear(6, 8), "p": torch.nn.Linear(8, 3),
                                     "q": torch.nn.Linear(8, 3)})
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(),
                                             compression=compressions[label]())
        for step in range(steps):
            optimizer.zero_grad()
            x, y = _batch(hvd.rank(), step)
            hidden = torch.tanh(model["trunk"](x))
            loss = torch.nn.functional.mse_loss(model["p"](hidden), y)
            if hvd.rank() == 1:
                loss = loss + torch.nn.functional.mse_loss(model["q"](hidden), y)
            loss.backward()
            optimizer.step()
        out[label] = _params(model)
    return out


def test_stock_optimizer_rank_dependent_parameters():
    """Ranks whose losses use different parameters, stock optimizer, hvdcomp compressor: no
    CarrierMismatchError or hang, replicas identical after several steps, and close to Horovod uncompressed
    (QSGD 8 bits with this step's scale; with the scale agreed a step ahead, what exceeds it follows a step
    later, as GlobalRandK sends half of each step and the rest follows through error feedback)."""
    codecs = ["qsgd8", "qsgd8_ahead", "randk05"]
    per_codec = run_function(_per_codec, np=2, kwargs={"worker": _stock_rank_dependent_heads_worker,
                                                       "codecs": codecs}, timeout=TIMEOUT)
    for codec in codecs:
        results = [r[codec] for r in per_codec]
        _assert_replicas_identical(results, codec)
        _assert_replicas_identical(results, "none")
        tolerance = 0.01 if codec == "qsgd8" else 0.1  # the others hold back part of the last step
        for ours, ref in zip(results[0][codec], results[0]["none"]):
            assert torch.isfinite(ours).all(), codec
            torch.testing.assert_close(ours, ref, rtol=0, atol=tolerance, msg=codec)


# --------------------------------------------------------------------------------------------------
# frozen parameters
# --------------------------------------------------------------------------------------------------


def _frozen_worker(variant):
    """A frozen first layer; the optimizer gets every parameter, or the trainable ones only (fine-tuning).
    Ours and Horovod's train the same steps; returns both runs' parameters."""
    import horovod.torch as hvd

    import hvdcomp

    out = {}
    for label, factory in (("horovod", hvd.DistributedOptimizer), ("ours", hvdcomp.DistributedOptimizer)):
        model = _mlp()
        model[0].requires_grad_(False)
        params = model.parameters() if variant == "frozen_in_optimizer" else [
            p for p in model.parameters() if p.requires_grad]
        optimizer = factory(torch.optim.SGD(params, lr=0.1, momentum=0.5), named_parameters=model.named_parameters())
        _train(model, optimizer, 3)
        out[label] = _params(model)
    out["start"] = _params(_mlp())
    return out


def test_frozen_parameters_are_accepted():
    variants = ["frozen_in_optimizer", "trainable_only"]
    per_variant = run_function(_per_codec, np=2, kwargs={"worker": _frozen_worker, "codecs": variants},
                               timeout=TIMEOUT)
    for variant in variants:
        results = [r[variant] for r in per_variant]
        _assert_replicas_identical(results, "ours")
        for r in results:
            for ours, ref in zip(r["ours"], r["horovod"]):
                torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6, msg=variant)
            for ours, start in zip(r["ours"][:2], r["start"][:2]):
                assert torch.equal(ours, start), variant  # the frozen layer does not move


# --------------------------------------------------------------------------------------------------
# step() after an earlier synchronize(): warn with Horovod's text, then synchronize
# --------------------------------------------------------------------------------------------------


def _step_after_synchronize_worker(codec):
    """Iteration 0: backward, synchronize(), no step, zero_grad(). Iteration 1: backward, step() (warns,
    must exchange). Then zero_grad() and one ordinary step. Same sequence on Horovod's optimizer."""
    import warnings

    import horovod.torch as hvd

    import hvdcomp

    out = {}
    for label, factory, compression in (("horovod", hvd.DistributedOptimizer, hvd.Compression.none),
                                        ("ours", hvdcomp.DistributedOptimizer, _codec(codec))):
        model = _mlp()
        optimizer = factory(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                            compression=compression)
        _mlp_loss(model, hvd.rank(), 0).backward()
        optimizer.synchronize()
        optimizer.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _mlp_loss(model, hvd.rank(), 1).backward()
            optimizer.step()
        out[f"{label}.warnings"] = [str(w.message) for w in caught if "synchronize" in str(w.message)]
        out[f"{label}.after_step"] = _params(model)
        try:
            optimizer.zero_grad()
            out[f"{label}.zero_grad"] = "ok"
        except Exception as error:  # noqa: BLE001 (reported by the test)
            out[f"{label}.zero_grad"] = f"{type(error).__name__}: {error}"
            continue
        _train(model, optimizer, 1, first_step=2)
        out[label] = _params(model)
    return out


def _same_params(results, key):
    return all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0][key], r[key]))


def test_step_after_synchronize_warns_and_resynchronizes():
    per_codec = run_function(_per_codec, np=2, kwargs={"worker": _step_after_synchronize_worker,
                                                       "codecs": ["none", "qsgd8"]}, timeout=TIMEOUT)
    for codec in ("none", "qsgd8"):
        _check_step_after_synchronize([r[codec] for r in per_codec], codec)


def _check_step_after_synchronize(results, codec):
    assert all(r["horovod.warnings"] == [HOROVOD_STEP_WARNING] for r in results)  # the pinned Horovod's text
    problems = []
    for rank, r in enumerate(results):
        if r["ours.warnings"] != r["horovod.warnings"]:
            problems.append(f"rank {rank}: warned {r['ours.warnings']!r}, Horovod warns {r['horovod.warnings']!r}")
        if r["ours.zero_grad"] != "ok":
            problems.append(f"rank {rank}: zero_grad() after that step raised {r['ours.zero_grad']}")
    if not _same_params(results, "ours.after_step"):
        problems.append("the replicas differ after step(): it did not exchange the gradients")
    if all("ours" in r for r in results):
        if not _same_params(results, "ours"):
            problems.append("the replicas differ after the next ordinary step")
        if codec == "none":
            for r in results:
                for ours, ref in zip(r["ours"], r["horovod"]):
                    if not torch.allclose(ours, ref, rtol=1e-5, atol=1e-6):
                        problems.append("the parameters differ from Horovod's after the same sequence")
                        break
    assert not problems, codec + ":\n" + "\n".join(problems)


# --------------------------------------------------------------------------------------------------
# two wrapped optimizers, one backward
# --------------------------------------------------------------------------------------------------


def _two_optimizers_worker(codec):
    """SGD for the backbone, Adam for the head, one backward per step; Horovod's optimizer as reference."""
    import horovod.torch as hvd

    import hvdcomp

    out = {}
    for label, factory in (("horovod", hvd.DistributedOptimizer), ("ours", hvdcomp.DistributedOptimizer)):
        compression = (lambda: hvd.Compression.none) if label == "horovod" else (lambda: _codec(codec))
        model = _mlp()
        backbone = factory(torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.5),
                           named_parameters=model[0].named_parameters(prefix="backbone"), compression=compression())
        head = factory(torch.optim.Adam(model[2].parameters(), lr=0.01),
                       named_parameters=model[2].named_parameters(prefix="head"), compression=compression())
        for step in range(3):
            backbone.zero_grad()
            head.zero_grad()
            _mlp_loss(model, hvd.rank(), step).backward()
            backbone.step()
            head.step()
        out[label] = _params(model)
    return out


def _check_against_horovod(worker):
    """``worker`` with plain all-reduce and with QSGD (the scale agreed ahead), in one launch: identical
    replicas, and the plain all-reduce matches Horovod's optimizer."""
    per_codec = run_function(_per_codec, np=2, kwargs={"worker": worker, "codecs": ["none", "qsgd8_ahead"]},
                             timeout=TIMEOUT)
    for codec in ("none", "qsgd8_ahead"):
        results = [r[codec] for r in per_codec]
        _assert_replicas_identical(results, "ours")
        if codec == "none":
            for r in results:
                for ours, ref in zip(r["ours"], r["horovod"]):
                    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_two_optimizers_one_backward():
    _check_against_horovod(_two_optimizers_worker)


# --------------------------------------------------------------------------------------------------
# FP16 error feedback: a non-finite (overflowing) step leaves the memories untouched
# --------------------------------------------------------------------------------------------------


def _fp16_overflow_worker():
    """Two runs of the same batches; run "overflow" has one extra step in which rank 1's gradient overflows
    float16 (Inf after the exchange on every rank); that step is skipped like GradScaler does. With the
    memories untouched by it, both runs end with the same parameters."""
    import horovod.torch as hvd

    import hvdcomp

    out = {}
    for label in ("clean", "overflow"):
        model = _mlp()
        optimizer = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                 named_parameters=model.named_parameters(),
                                                 compression=hvdcomp.FP16(error_feedback=True))
        schedule = [0, 1, "overflow", 2, 3] if label == "overflow" else [0, 1, 2, 3]
        for step in schedule:
            optimizer.zero_grad()
            if step == "overflow":
                loss = _mlp_loss(model, hvd.rank(), 99) * (1e7 if hvd.rank() == 1 else 1.0)
            else:
                loss = _mlp_loss(model, hvd.rank(), step)
            loss.backward()
            optimizer.synchronize()
            finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            if step == "overflow":
                out["overflow_step_was_nonfinite"] = not finite
            if not finite:  # skip the step, as torch.amp.GradScaler would
                optimizer.zero_grad()
            with optimizer.skip_synchronize():
                optimizer.step()
        out[label] = _params(model)
    return out


def test_fp16_error_feedback_skips_nonfinite_steps():
    results = run_function(_fp16_overflow_worker, np=2, timeout=TIMEOUT)
    _assert_replicas_identical(results, "overflow")
    for r in results:
        assert r["overflow_step_was_nonfinite"]  # the test really overflowed
        for p in r["overflow"]:
            assert bool(torch.isfinite(p).all()), "an Inf residual poisoned later steps"
        for a, b in zip(r["overflow"], r["clean"]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# FP16 over MPITransport
# --------------------------------------------------------------------------------------------------


def _fp16_mpi_worker(codec):
    import horovod.torch as hvd

    import hvdcomp

    model = _mlp()
    params = list(model.parameters())
    optimizer = hvdcomp.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), named_parameters=model.named_parameters(),
                                             compression=_codec(codec), transport=hvdcomp.MPITransport())
    errors = []
    for step in range(3):
        optimizer.zero_grad()
        errors.append(_step_error(optimizer, _mlp_loss(model, hvd.rank(), step), params))
    return {"params": _params(model), "errors": errors}


@pytest.mark.mpi
def test_fp16_over_mpi_transport():
    pytest.importorskip("mpi4py")
    codecs = ["fp16", "fp16_ef", "horovod_fp16"]
    per_codec = run_function(_per_codec, np=2, launcher="mpi", kwargs={"worker": _fp16_mpi_worker, "codecs": codecs},
                             timeout=TIMEOUT)
    for codec in codecs:
        results = [r[codec] for r in per_codec]
        _assert_replicas_identical(results, "params")
        for r in results:
            assert max(r["errors"]) <= _TOLERANCE[codec], (codec, r["errors"])


# --------------------------------------------------------------------------------------------------
# GlobalRandK's absolute k: per tensor everywhere (stock path, buckets, hierarchical shards)
# --------------------------------------------------------------------------------------------------

K = 14
RANDK_SHAPES = {"w1": (3, 9), "w2": (5, 7), "w3": (45,)}  # 27, 35, 45 elements: all >= K, all odd


def _randk_counts_worker(configs):
    """For each config, one exchange of dense gradients in [0.5, 1] through GlobalRandKMaxNorm(k=K, no error
    feedback); returns how many elements of each tensor came back non-zero (the coordinates sent)."""
    import horovod.torch as hvd

    import hvdcomp

    out = {}
    for config in configs:
        gen = torch.Generator().manual_seed(7)
        model = torch.nn.ParameterDict({name: torch.nn.Parameter(torch.randn(shape, generator=gen))
                                        for name, shape in RANDK_SHAPES.items()})
        compression = hvdcomp.GlobalRandKMaxNorm(k=K, bits=8, error_feedback=False, min_compress_numel=0)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        if config == "stock":
            optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                                 compression=compression)
        else:
            hierarchical, buckets = config.split("_")
            optimizer = hvdcomp.DistributedOptimizer(
                sgd, named_parameters=model.named_parameters(), compression=compression,
                hierarchical=hierarchical == "hierarchical",
                bucket_size_mb=TINY_BUCKETS if buckets == "tiny" else 25.0)
        coef = torch.Generator().manual_seed(100 + hvd.rank())
        loss = sum((p * (0.5 + 0.5 * torch.rand(p.shape, generator=coef))).sum() for p in model.values())
        loss.backward()
        optimizer.synchronize()
        out[config] = {name: int((p.grad != 0).sum()) for name, p in model.items()}
        with optimizer.skip_synchronize():
            optimizer.step()
    return out


def test_randk_k_is_per_tensor_flat():
    configs = ["stock", "flat_one", "flat_tiny"]
    results = run_function(_randk_counts_worker, np=2, kwargs={"configs": configs}, timeout=TIMEOUT)
    for r in results:
        for config in configs:
            assert r[config] == {name: K for name in RANDK_SHAPES}, (config, r[config])


def test_randk_k_is_per_tensor_hierarchical():
    configs = ["stock", "hierarchical_one", "hierarchical_tiny"]
    results = run_function(_randk_counts_worker, np=4, hosts=EMULATED_NODES, init_kwargs=DYNAMIC,
                           kwargs={"configs": configs}, timeout=TIMEOUT)
    for r in results:
        for config in configs:
            assert r[config] == {name: K for name in RANDK_SHAPES}, (config, r[config])


# --------------------------------------------------------------------------------------------------
# Birder's configuration checks run on every rank (3 workers as 2 + 1)
# --------------------------------------------------------------------------------------------------


def _birder_uneven_worker(hierarchical=True):
    import hvdcomp

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(10))]
    optimizer = hvdcomp.Birder(params, lr=0.1, hierarchical=hierarchical)
    params[0].grad = torch.randn(10)
    try:
        optimizer.step()
    except Exception as error:  # noqa: BLE001 (reported by the test)
        return f"{type(error).__name__}: {error}"
    return "stepped"


def test_birder_uneven_nodes_fails_on_every_rank():
    results = run_function(_birder_uneven_worker, np=3, hosts=UNEVEN_NODES, init_kwargs=DYNAMIC, timeout=TIMEOUT)
    for rank, message in enumerate(results):
        assert message != "stepped", (rank, results)
        assert "shut down" not in message and "HorovodInternalError" not in message, (rank, results)
        assert re.search(r"node|hierarch", message, re.I), (rank, results)


def test_birder_route_left_open_on_uneven_nodes_steps_flat():
    """hierarchical=None on nodes of 2 + 1: no route trial; every rank steps (the node check is a collective that
    every rank reaches, whatever its own node's size)."""
    results = run_function(_birder_uneven_worker, np=3, hosts=UNEVEN_NODES, kwargs={"hierarchical": None},
                           init_kwargs=DYNAMIC, timeout=TIMEOUT)
    assert results == ["stepped"] * 3, results


# --------------------------------------------------------------------------------------------------
# Birder: no weight decay for frozen parameters and parameters without a gradient (like AdamW)
# --------------------------------------------------------------------------------------------------


def _birder_decay_worker():
    import horovod.torch as hvd

    import hvdcomp

    out = {}
    for label in ("adamw", "birder"):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"frozen": torch.nn.Linear(6, 8), "used": torch.nn.Linear(8, 3),
                                     "unused": torch.nn.Linear(8, 3)})
        model["frozen"].requires_grad_(False)
        start = {name: _params(module) for name, module in model.items()}
        if label == "adamw":  # the reference semantics, locally
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        else:
            optimizer = hvdcomp.Birder(model.parameters(), lr=0.05, weight_decay=0.1)
        for step in range(3):
            optimizer.zero_grad()
            x, y = _batch(hvd.rank(), step)
            torch.nn.functional.mse_loss(model["used"](torch.tanh(model["frozen"](x))), y).backward()
            optimizer.step()
        out[label] = {name: [float((p - s).abs().max()) for p, s in zip(_params(module), start[name])]
                      for name, module in model.items()}
        out[f"{label}.params"] = _params(model)
    return out


def test_birder_skips_weight_decay_without_gradient():
    results = run_function(_birder_decay_worker, np=2, timeout=TIMEOUT)
    _assert_replicas_identical(results, "birder.params")
    for r in results:
        assert r["adamw"]["frozen"] == [0.0, 0.0] and r["adamw"]["unused"] == [0.0, 0.0]  # what AdamW does
        assert min(r["birder"]["used"]) > 0
        assert r["birder"]["frozen"] == [0.0, 0.0], r["birder"]
        assert r["birder"]["unused"] == [0.0, 0.0], r["birder"]


# --------------------------------------------------------------------------------------------------
# keyword and positional parity with hvd.DistributedOptimizer
# --------------------------------------------------------------------------------------------------

HOROVOD_ORDER = ["optimizer", "named_parameters", "compression", "backward_passes_per_step", "op",
                 "gradient_predivide_factor", "num_groups", "groups", "sparse_as_dense", "process_set"]


def _positional_worker():
    import horovod.torch as hvd

    import hvdcomp

    out = {"signature": list(inspect.signature(hvdcomp.DistributedOptimizer).parameters)}
    for label, factory in (("horovod", hvd.DistributedOptimizer), ("ours", hvdcomp.DistributedOptimizer)):
        model = _mlp()
        # Horovod's positional order, up to process_set
        optimizer = factory(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                            hvd.Compression.none, 1, hvd.Average, 1.0, 0, None, False, hvd.global_process_set)
        _train(model, optimizer, 2)
        out[label] = _params(model)
    return out


def test_positional_order_matches_horovod():
    results = run_function(_positional_worker, np=2, timeout=TIMEOUT)
    assert results[0]["signature"][:len(HOROVOD_ORDER)] == HOROVOD_ORDER, results[0]["signature"]
    for r in results:
        for ours, ref in zip(r["ours"], r["horovod"]):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def _groups_worker():
    """groups=int, groups=list of lists, num_groups=int: accepted, same result as Horovod's optimizer."""
    import warnings

    import horovod.torch as hvd

    import hvdcomp

    out = {}
    for option in ("groups_int", "groups_list", "num_groups"):
        for label, factory in (("horovod", hvd.DistributedOptimizer), ("ours", hvdcomp.DistributedOptimizer)):
            model = _mlp()
            grouping = {"groups_int": {"groups": 2},
                        "groups_list": {"groups": [[model[0].weight, model[2].weight]]},
                        "num_groups": {"num_groups": 2}}[option]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # Horovod deprecates num_groups
                optimizer = factory(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), **grouping)
            _train(model, optimizer, 2)
            out[(option, label)] = _params(model)
    return out


def test_groups_and_num_groups_are_accepted():
    results = run_function(_groups_worker, np=2, timeout=TIMEOUT)
    for r in results:
        for option in ("groups_int", "groups_list", "num_groups"):
            for ours, ref in zip(r[(option, "ours")], r[(option, "horovod")]):
                torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def _sparse_worker():
    """An Embedding with sparse gradients, sparse_as_dense True and False, against Horovod's optimizer."""
    import horovod.torch as hvd

    import hvdcomp

    out = {}
    for sparse_as_dense in (True, False):
        for label, factory in (("horovod", hvd.DistributedOptimizer), ("ours", hvdcomp.DistributedOptimizer)):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 3))
            optimizer = factory(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                sparse_as_dense=sparse_as_dense)
            for step in range(2):
                optimizer.zero_grad()
                ids = torch.randint(0, 10, (5,), generator=torch.Generator().manual_seed(10 * step + hvd.rank()))
                model(ids).pow(2).mean().backward()
                optimizer.step()
            out[(sparse_as_dense, label)] = _params(model)
    return out


def test_sparse_as_dense_is_accepted():
    results = run_function(_sparse_worker, np=2, timeout=TIMEOUT)
    _assert_replicas_identical(results, (True, "ours"))
    _assert_replicas_identical(results, (False, "ours"))
    for r in results:
        for mode in (True, False):
            for ours, ref in zip(r[(mode, "ours")], r[(mode, "horovod")]):
                torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def _stock_sparse_worker():
    """Horovod's own optimizer with our compressor and a sparse Embedding (sparse_as_dense=False): Horovod
    reduces the sparse gradient itself and calls decompress(output, None)."""
    import horovod.torch as hvd

    import hvdcomp

    out = {}
    for label, compression in (("horovod", hvd.Compression.none),
                               ("ours", hvdcomp.QSGDMaxNorm(8, min_compress_numel=0))):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 3))
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(), compression=compression)
        for step in range(2):
            optimizer.zero_grad()
            ids = torch.randint(0, 10, (5,), generator=torch.Generator().manual_seed(10 * step + hvd.rank()))
            model(ids).pow(2).mean().backward()
            optimizer.step()
        out[label] = _params(model)
    return out


def test_stock_optimizer_sparse_gradients_pass_through_decompress():
    results = run_function(_stock_sparse_worker, np=2, timeout=TIMEOUT)
    _assert_replicas_identical(results, "ours")
    for r in results:  # the embedding is reduced exactly by Horovod; the linear layer through QSGD 8 bits
        torch.testing.assert_close(r["ours"][0], r["horovod"][0], rtol=1e-5, atol=1e-6)


def _outside_process_set_worker():
    """process_set = {rank 0}: on rank 1 the optimizer is a no-op (local SGD), as Horovod's is."""
    import horovod.torch as hvd

    import hvdcomp

    only_rank0 = hvd.add_process_set([0])
    out = {}
    for label, factory in (("local", None), ("horovod", hvd.DistributedOptimizer),
                           ("ours", hvdcomp.DistributedOptimizer)):
        model = _mlp()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer = sgd if factory is None else factory(sgd, named_parameters=model.named_parameters(),
                                                        process_set=only_rank0)
        _train(model, optimizer, 2)
        out[label] = _params(model)
    return out


def test_rank_outside_process_set_is_a_noop():
    results = run_function(_outside_process_set_worker, np=2, init_kwargs=DYNAMIC, timeout=TIMEOUT)
    for r in results:
        for ours, ref, local in zip(r["ours"], r["horovod"], r["local"]):
            torch.testing.assert_close(ref, local, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(ours, local, rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# detaching an optimizer: close() and the context manager
# --------------------------------------------------------------------------------------------------


def _detach_worker(codec):
    """One model, optimizers created one after another over the same parameters: close() detaches the first,
    a ``with`` block the third. After each detach, a backward on rank 0 only (say, a diagnostic gradient)
    must start no exchange. Reference: Horovod's optimizer over the same steps (SGD is stateless)."""
    import horovod.torch as hvd

    import hvdcomp

    def make(model):
        return hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            named_parameters=model.named_parameters(), compression=_codec(codec))

    def rank0_only_backward(model):
        if hvd.rank() == 0:
            _mlp_loss(model, 0, 50).backward()
        model.zero_grad()

    model = _mlp()
    first = make(model)
    _train(model, first, 2, first_step=0)
    first.close()
    rank0_only_backward(model)
    second = make(model)
    _train(model, second, 2, first_step=2)
    second.close()
    with make(model) as third:
        _train(model, third, 2, first_step=4)
    rank0_only_backward(model)
    fourth = make(model)
    _train(model, fourth, 2, first_step=6)

    reference = _mlp()
    _train(reference, hvd.DistributedOptimizer(torch.optim.SGD(reference.parameters(), lr=0.1),
                                               named_parameters=reference.named_parameters()), 8)
    return {"ours": _params(model), "horovod": _params(reference)}


def test_close_and_context_manager_detach_hooks():
    _check_against_horovod(_detach_worker)


# --------------------------------------------------------------------------------------------------
# one rank raises mid-step
# --------------------------------------------------------------------------------------------------


def _raise_mid_step_worker(kind):
    """Rank 0 (Horovod's coordinator) raises in the middle of step 1's backward, after the later layers'
    gradients (and their buckets) went out. The others must end with a Horovod error, not hang."""
    import horovod.torch as hvd

    import hvdcomp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 3))
    if kind == "birder":
        optimizer = hvdcomp.Birder(model.parameters(), lr=0.05)
    else:
        optimizer = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                 named_parameters=model.named_parameters(),
                                                 compression=hvdcomp.QSGDMaxNorm(8), bucket_size_mb=TINY_BUCKETS,
                                                 hierarchical=kind == "hierarchical")
    for step in range(3):
        optimizer.zero_grad()
        x, y = _batch(hvd.rank(), step)
        hidden = model[0](x)
        if step == 1 and hvd.rank() == 0:
            def fail(grad):
                raise RuntimeError("injected failure on rank 0")

            hidden.register_hook(fail)
        torch.nn.functional.mse_loss(model[1:](hidden), y).backward()
        optimizer.step()
    return "finished"


@pytest.mark.parametrize("kind", ["flat", "hierarchical", "birder"])
def test_one_rank_raises_mid_step(kind):
    np, extra = (2, {}) if kind == "flat" else (4, {"hosts": EMULATED_NODES, "init_kwargs": DYNAMIC})
    # With node-local process sets a rank may wait out Gloo's timeout (30 s by default; a run on a loaded machine
    # whose ranks timed out so took 89 s of the 90 allowed) before Horovod's Gloo layer aborts it: 10 s here.
    env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "10"}
    with pytest.raises(AssertionError) as failure:
        run_function(_raise_mid_step_worker, np=np, kwargs={"kind": kind}, timeout=TIMEOUT, env=env, **extra)
    message = str(failure.value)
    assert "timed out" not in message.splitlines()[0], message[-4000:]
    tracebacks = _rank_tracebacks(message)
    assert "injected failure on rank 0" in tracebacks.get(0, ""), message[-4000:]
    launcher = message.split("----- launcher output")[-1]
    for rank in range(1, np):
        text = tracebacks.get(rank, "")
        if "HorovodInternalError" in text or "Horovod has been shut down" in text:
            continue
        # With dynamic process sets (hierarchical), Horovod's Gloo layer may instead abort the process
        # ("gloo::IoException", exit 134); on any route, horovodrun may end a rank (SIGTERM, exit 143) after the
        # failure of rank 0 or of a rank that already reported Horovod's error, before that rank reports its own
        # (its exit status printed, or only the shell's "Terminated" on its stderr; seen on a loaded machine with
        # the flat route too): still an error, not a hang.
        ended_by_launcher = ("Terminating remaining workers after failure of Process" in launcher
                             and (f"Process {rank} exit with status code 143" in launcher
                                  or f"[{rank}]<stderr>:Terminated" in launcher))
        aborted_by_gloo = kind == "hierarchical" and "gloo::IoException" in launcher
        assert aborted_by_gloo or ended_by_launcher, f"rank {rank} did not end with a Horovod error\n" + message[-6000:]


# --------------------------------------------------------------------------------------------------
# hvd.broadcast_parameters / hvd.broadcast_optimizer_state (all ranks start empty)
# --------------------------------------------------------------------------------------------------


def _broadcast_worker(kind):
    """Rank-dependent initial weights; broadcast_parameters makes them rank 0's, broadcast_optimizer_state
    (which steps empty optimizers with zero gradients) must not move them; training then keeps replicas equal."""
    import horovod.torch as hvd

    import hvdcomp

    model = _mlp(seed=hvd.rank())
    if kind == "birder":  # with weight decay, a step with zero gradients would move the weights
        optimizer = hvdcomp.Birder(model.parameters(), lr=0.05, weight_decay=0.1)
    else:
        optimizer = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                                 named_parameters=model.named_parameters(),
                                                 compression=hvdcomp.QSGDMaxNorm(8))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    after_parameters = _params(model)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    after_state = _params(model)
    _train(model, optimizer, 2)
    return {"rank0_start": _params(_mlp(seed=0)), "after_parameters": after_parameters, "after_state": after_state,
            "trained": _params(model)}


@pytest.mark.parametrize("kind", ["ours", "birder"])
def test_broadcast_state_and_parameters_keep_weights(kind):
    results = run_function(_broadcast_worker, np=2, kwargs={"kind": kind}, timeout=TIMEOUT)
    for r in results:
        for start, a, b in zip(r["rank0_start"], r["after_parameters"], r["after_state"]):
            assert torch.equal(start, a) and torch.equal(a, b)
    _assert_replicas_identical(results, "trained")


# --------------------------------------------------------------------------------------------------
# the resume pattern, optimizer state on rank 0 only, then broadcast_optimizer_state
# --------------------------------------------------------------------------------------------------


def _checkpoint_broadcast_worker():
    """Rank 0 loads a checkpoint (model + optimizer state); the others start with empty state. Then
    hvd.broadcast_parameters and hvd.broadcast_optimizer_state: no hang, everyone holds rank 0's state."""
    import horovod.torch as hvd

    import hvdcomp

    out = {}
    for name, make in (("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
                       ("adam", lambda ps: torch.optim.Adam(ps, lr=0.01))):
        model = _mlp()
        optimizer = hvdcomp.DistributedOptimizer(make(model.parameters()), named_parameters=model.named_parameters(),
                                                 compression=hvdcomp.QSGDMaxNorm(8))
        if hvd.rank() == 0:  # a checkpoint written by an earlier single-process run
            earlier = _mlp()
            plain = make(earlier.parameters())
            for step in range(2):
                plain.zero_grad()
                _mlp_loss(earlier, 0, 100 + step).backward()
                plain.step()
            checkpoint = {"model": earlier.state_dict(), "optimizer": plain.state_dict()}
            model.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        state = optimizer.state_dict()["state"]
        out[f"{name}.state"] = [v.clone() for i in sorted(state) for k, v in sorted(state[i].items())
                                if torch.is_tensor(v)]
        out[f"{name}.after_broadcast"] = _params(model)
        _train(model, optimizer, 2)
        out[name] = _params(model)
    return out


def test_broadcast_state_from_rank0_checkpoint():
    results = run_function(_checkpoint_broadcast_worker, np=2, timeout=TIMEOUT)
    for name in ("sgd", "adam"):
        assert results[0][f"{name}.state"], name
        for key in (f"{name}.state", f"{name}.after_broadcast", name):
            _assert_replicas_identical(results, key)


# --------------------------------------------------------------------------------------------------
# optimizer._parameter_names with Horovod's meaning
# --------------------------------------------------------------------------------------------------


def _parameter_names_worker():
    import horovod.torch as hvd

    import hvdcomp

    out = {}
    for named in (True, False):
        maps = {}
        for label, factory in (("horovod", hvd.DistributedOptimizer), ("ours", hvdcomp.DistributedOptimizer)):
            model = _mlp()
            groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01}]
            kwargs = {"named_parameters": model.named_parameters()} if named else {}
            optimizer = factory(torch.optim.SGD(groups, lr=0.1), **kwargs)
            names = getattr(optimizer, "_parameter_names", None)
            maps[label] = None if names is None else [names.get(p) for p in model.parameters()]
            _train(model, optimizer, 1)
        out[named] = maps
    return out


def test_parameter_names_like_horovod():
    results = run_function(_parameter_names_worker, np=2, timeout=TIMEOUT)
    for r in results:
        for named in (True, False):
            assert r[named]["ours"] == r[named]["horovod"], (named, r[named])
    assert results[0][True]["horovod"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert results[0][False]["horovod"] == [f"allreduce.noname.{i}.{j}" for i in range(2) for j in range(2)]


# --------------------------------------------------------------------------------------------------
# hvdcomp state loaded on rank 0 only, names after a sub-process-set optimizer,
# sparse gradients with accumulation, one compression object for two optimizers
# --------------------------------------------------------------------------------------------------


def _rank0_only_hvdcomp_checkpoint_worker():
    """Rank 0 resumes from an hvdcomp checkpoint (GlobalRandK state, exchange step 3), the others start
    fresh, then the usual broadcasts: the next exchange must fail on every rank, not drift apart."""
    import horovod.torch as hvd

    import hvdcomp

    def build():
        model = _mlp()
        return model, hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                   named_parameters=model.named_parameters(),
                                                   compression=hvdcomp.GlobalRandKMaxNorm(ratio=0.5))

    model, optimizer = build()
    _train(model, optimizer, 3)
    checkpoint = optimizer.state_dict()
    optimizer.close()
    model, optimizer = build()
    if hvd.rank() == 0:
        optimizer.load_state_dict(checkpoint)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    try:
        _train(model, optimizer, 1, first_step=3)
    except RuntimeError as error:
        return str(error)
    return "trained"


def test_hvdcomp_state_loaded_on_some_ranks_only_fails_on_every_rank():
    results = run_function(_rank0_only_hvdcomp_checkpoint_worker, np=2, timeout=TIMEOUT)
    for rank, message in enumerate(results):
        assert "different hvdcomp states" in message and "load its own" in message, (rank, message)


def _names_after_subset_optimizer_worker():
    """An optimizer over process set {0} (a no-op on rank 1), then a global one whose parameters have the
    same (unnamed) names: its collective names must agree on both ranks."""
    import horovod.torch as hvd

    import hvdcomp

    only_rank0 = hvd.add_process_set([0])
    first = _mlp()
    hvdcomp.DistributedOptimizer(torch.optim.SGD(first.parameters(), lr=0.1), process_set=only_rank0)
    model = _mlp()
    optimizer = hvdcomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             compression=hvdcomp.QSGDMaxNorm(8))
    _train(model, optimizer, 2)
    return _params(model)


def test_names_agree_after_an_optimizer_over_a_smaller_process_set():
    results = run_function(_names_after_subset_optimizer_worker, np=2, init_kwargs=DYNAMIC, timeout=TIMEOUT)
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a, b)


def _sparse_accumulation_worker():
    """Sparse embedding gradients, two backward passes per step, sparse_as_dense=False: one sparse reduce
    per step (as Horovod), same result as Horovod's optimizer; zero_grad() between the passes is refused
    as Horovod refuses it."""
    import horovod.torch as hvd

    import hvdcomp

    out = {}
    for label, factory in (("horovod", hvd.DistributedOptimizer), ("ours", hvdcomp.DistributedOptimizer)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 3))
        optimizer = factory(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                            backward_passes_per_step=2)
        for step in range(2):
            optimizer.zero_grad()
            for half in range(2):
                ids = torch.randint(0, 10, (5,), generator=torch.Generator().manual_seed(100 * step + 10 * half
                                                                                          + hvd.rank()))
                model(ids).pow(2).mean().backward()
                if step == 1 and half == 0:
                    try:
                        optimizer.zero_grad()
                        out[f"{label}.zero_grad_between_passes"] = "accepted"
                    except AssertionError:
                        out[f"{label}.zero_grad_between_passes"] = "refused"
            optimizer.step()
        out[label] = _params(model)
    return out


def test_sparse_gradients_with_accumulation():
    results = run_function(_sparse_accumulation_worker, np=2, timeout=TIMEOUT)
    _assert_replicas_identical(results, "ours")
    for r in results:
        assert r["horovod.zero_grad_between_passes"] == r["ours.zero_grad_between_passes"] == "refused"
        for ours, ref in zip(r["ours"], r["horovod"]):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def _shared_codec_worker():
    import hvdcomp

    model = _mlp()
    shared = hvdcomp.GlobalRandKMaxNorm(ratio=0.5)
    first = hvdcomp.DistributedOptimizer(torch.optim.SGD(model[0].parameters(), lr=0.1), compression=shared)
    try:
        hvdcomp.DistributedOptimizer(torch.optim.SGD(model[2].parameters(), lr=0.1), compression=shared)
    except ValueError as error:
        message = str(error)
    else:
        message = "accepted"
    first.close()  # a closed (or dropped) optimizer releases its compression object
    again = hvdcomp.DistributedOptimizer(torch.optim.SGD(model[2].parameters(), lr=0.1), compression=shared)
    return message, len(again._hooks)


def test_one_compression_object_serves_one_optimizer():
    results = run_function(_shared_codec_worker, np=2, timeout=TIMEOUT)
    assert all("already serves another" in message and hooks == 2 for message, hooks in results), results


def test_a_process_set_horovod_dropped_is_a_horovod_internal_error():
    """After Horovod shut down (a rank failed), its process sets are gone: a collective on one fails with
    HorovodInternalError, as the others do (elastic training recovers from it), not a bare ValueError."""
    code = ("import horovod.torch as hvd, torch\n"
            "from horovod.common.exceptions import HorovodInternalError\n"
            "from hvdcomp.exchange.protocol import Op\n"
            "from hvdcomp.transport.horovod import HorovodTransport\n"
            "hvd.init()\n"
            "dropped = hvd.ProcessSet([0])\n"
            "dropped.process_set_id = 7  # an id Horovod does not hold, as after its shutdown\n"
            "for op in (Op.SUM, Op.MAX, Op.ALLGATHER, Op.ALLTOALL):\n"
            "    try:\n"
            "        HorovodTransport(dropped).start(op, torch.ones(4))\n"
            "    except HorovodInternalError as error:\n"
            "        assert 'no process set of ranks [0]' in str(error) and isinstance(error.__cause__, ValueError)\n"
            "    else:\n"
            "        raise AssertionError(op)\n"
            "print(HorovodTransport().collective(Op.SUM, torch.ones(2)).tolist())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("[1.0, 1.0]"), done.stderr[-3000:]
