"""The stock hvd.DistributedOptimizer path identifies gradients by Horovod's own names.

``hvdcomp.transport._compat.stock_call`` reads them from Horovod's frames; these tests fail loudly if the
installed Horovod no longer has the code or locals it reads, and check on the real optimizer (one
process, then two workers) that state is keyed by name, that each step's gradients are exchanged
together in synchronize() (one collective per round), and that a parameter used on one rank only
works as in stock Horovod.
"""

import subprocess
import sys
import textwrap

import pytest

from hvdcomp.transport import _compat
from tests.harness import run_function


def test_the_pinned_horovod_has_the_code_and_locals_read():
    import horovod.torch.optimizer

    assert _compat.HOROVOD_OPTIMIZER_MODULE == horovod.torch.optimizer.__name__
    single, grouped = _compat.stock_codes()
    assert None not in (single, grouped)
    assert {"self", "p", "name"} <= set(single.co_varnames)
    assert "compress" in single.co_names and "_parameter_names" in single.co_names
    comprehension = [c for c in grouped.co_consts if hasattr(c, "co_varnames")]
    grouped_names = {n for code in (grouped, *comprehension) for n in code.co_varnames + code.co_names}
    assert {"self", "p", "compress"} <= grouped_names


def test_calls_from_elsewhere_are_not_identified_and_unknown_horovod_code_fails_loudly():
    assert _compat.stock_call(sys._getframe()) is None
    namespace = {"__name__": _compat.HOROVOD_OPTIMIZER_MODULE, "sys": sys, "stock_call": _compat.stock_call}
    exec(compile("def compress_site():\n    return stock_call(sys._getframe())\n", "<horovod>", "exec"), namespace)
    with pytest.raises(RuntimeError, match="compress was called from compress_site.*Horovod >=0.28.1,<0.29"):
        namespace["compress_site"]()


_ONE_PROCESS = textwrap.dedent("""
    import os, pickle, sys
    import horovod.torch as hvd, torch, hvdcomp

    hvd.init()

    def run(compression, groups=None):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({name: torch.nn.Linear(3, 3) for name in ("trunk", "h1", "h2", "h3")})
        os.environ["HOROVOD_ELASTIC"] = "1"  # Horovod registers its hooks on one worker too
        try:
            optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                                 named_parameters=model.named_parameters(),
                                                 compression=compression, groups=groups)
        finally:
            del os.environ["HOROVOD_ELASTIC"]
        transport, calls = compression.stock().transport, []
        collective = transport.collective
        transport.collective = lambda op, t: calls.append((op.name, t.numel())) or collective(op, t)
        for step in range(2):
            optimizer.zero_grad()
            head = model["h1"] if step == 0 else model["h2"]
            head(torch.tanh(model["trunk"](torch.ones(4, 3)))).sum().backward()
            optimizer.step()
        memory = compression.max_norm.memory
        return {"steps": compression.stock().state_dict()["steps"], "calls": calls,
                "memory": None if memory is None else sorted(memory.state_dict()["residuals"])}

    class Logged(hvdcomp.QSGDMaxNorm):  # a user's wrapper around compress must keep Horovod's names
        def compress(self, tensor):
            return super().compress(tensor)

    out = {"plain": run(hvdcomp.QSGDMaxNormMultiScale((3, 8), min_compress_numel=0)),
           "randk": run(hvdcomp.GlobalRandKMaxNorm(ratio=0.5, min_compress_numel=0)),
           "wrapped": run(Logged(8, min_compress_numel=0)),
           "groups": run(hvdcomp.QSGDMaxNorm(8, min_compress_numel=0), groups=2)}
    sys.stdout.buffer.write(pickle.dumps(out))
""")


@pytest.mark.slow
def test_stock_optimizer_keys_state_by_name_and_batches_missing_gradients():
    done = subprocess.run([sys.executable, "-c", _ONE_PROCESS], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    import pickle

    out = pickle.loads(done.stdout)
    names = {f"{module}.{kind}" for module in ("trunk", "h1", "h2", "h3") for kind in ("weight", "bias")}
    for run in out.values():
        assert run["steps"] == dict.fromkeys(names, 2)  # every gradient exchanged once a step, by name
    assert out["randk"]["memory"] == sorted(names)
    # compress issues no collective: each step's eight gradients (used or not) are exchanged together at the
    # first decompress, one collective per round: a MAX (per gradient 1 scale + NaN flag + 2 stamp values),
    # for multi-scale a SUM of agreement words, then one PAYLOAD of every packed level
    calls = out["plain"]["calls"]
    assert [op for op, _ in calls] == ["MAX", "SUM", "PAYLOAD"] * 2
    assert calls[0] == ("MAX", 8 * 4) and calls[3] == ("MAX", 8 * 4) and calls[2] == calls[5]
    assert [op for op, _ in out["randk"]["calls"]] == ["MAX", "PAYLOAD"] * 2
    # groups=2: the grouped path (names read from the comprehension's frame) batches the same way; QSGD's
    # default scale="ahead" needs the batch at the first step only (later payloads travel in the carriers)
    groups = out["groups"]["calls"]
    assert [op for op, _ in groups] == ["MAX", "PAYLOAD"] and groups[0] == ("MAX", 8 * 4)


def _branch_worker():
    """Rank 0 uses branch ``a``, rank 1 branch ``b``: each rank compresses the other's branch in
    synchronize() (zero-filled), as stock Horovod all-reduces it. Returns the parameters after a step with
    Horovod's uncompressed all-reduce and with QSGD 8 bits."""
    import horovod.torch as hvd
    import torch

    import hvdcomp

    out = {}
    for label, compression in (("none", hvd.Compression.none),
                               ("qsgd8", hvdcomp.QSGDMaxNorm(8, scale="exact", min_compress_numel=0))):
        # this step's scale: within 8-bit rounding of Horovod (scale="ahead" may hold back a clipped part of
        # the last step; tests/test_robust_mp.py's qsgd8_ahead case covers it with per-rank parameters)
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({name: torch.nn.Linear(4, 4) for name in ("trunk", "a", "b", "out")})
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(), compression=compression)
        branch = model["a"] if hvd.rank() == 0 else model["b"]
        for _ in range(2):
            optimizer.zero_grad()
            model["out"](branch(model["trunk"](torch.ones(2, 4)))).sum().backward()
            optimizer.step()
        out[label] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.slow
def test_stock_optimizer_with_a_parameter_used_on_one_rank_only_works_as_in_horovod():
    import torch

    results = run_function(_branch_worker, np=2, timeout=60)
    for label in ("none", "qsgd8"):
        for a, b in zip(results[0][label], results[1][label]):
            assert torch.equal(a, b), label  # identical replicas
    for ours, ref in zip(results[0]["qsgd8"], results[0]["none"]):
        torch.testing.assert_close(ours, ref, rtol=0, atol=0.02)  # two steps of lr 0.1, 8-bit rounding


_RESUME = textwrap.dedent("""
    import copy, os, pickle, sys
    import horovod.torch as hvd, torch, hvdcomp

    hvd.init()
    os.environ["HOROVOD_ELASTIC"] = "1"  # Horovod registers its hooks on one worker too

    def build(model):
        compression = hvdcomp.GlobalRandKMaxNorm(ratio=0.5, bits=4, min_compress_numel=0)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                             named_parameters=model.named_parameters(), compression=compression)
        return optimizer, compression

    def train(model, optimizer, steps, first):
        for step in range(first, first + steps):
            optimizer.zero_grad()
            head = model["h1"] if step % 2 else model["h2"]
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
            head(torch.tanh(model["trunk"](x))).pow(2).sum().backward()
            optimizer.step()

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({name: torch.nn.Linear(3, 3) for name in ("trunk", "h1", "h2")})
    optimizer, compression = build(model)
    train(model, optimizer, 3, 0)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "compression": compression.state_dict()})
    train(model, optimizer, 3, 3)
    resumed = torch.nn.ModuleDict({name: torch.nn.Linear(3, 3) for name in ("trunk", "h1", "h2")})
    resumed.load_state_dict(checkpoint["model"])
    optimizer2, compression2 = build(resumed)
    optimizer2.load_state_dict(checkpoint["optimizer"])
    compression2.load_state_dict(checkpoint["compression"])
    train(resumed, optimizer2, 3, 3)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))
    sys.stdout.buffer.write(pickle.dumps({"same": same, "steps": compression2.stock().state_dict()["steps"]}))
""")


@pytest.mark.slow
def test_stock_compressor_state_resumes_exactly():
    done = subprocess.run([sys.executable, "-c", _RESUME], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    import pickle

    out = pickle.loads(done.stdout)
    assert out["same"] and set(out["steps"].values()) == {6}
