"""``Op.ALLTOALL`` / ``Op.ALLGATHER`` over both transports (Horovod's all-to-alls and equal all-gathers whole
and in pieces), Horovod's float16 ``Op.SUM`` (Horovod's own, and all-to-all pieces summed at float32), and
``FP16`` through them, in real workers."""

import importlib.metadata

import pytest
import torch

from hvdcomp.exchange.elementwise import FP16
from hvdcomp.exchange.protocol import Op
from hvdcomp.exchange.simulator import simulate
from tests.harness import run_function


def _grads(rank):
    return torch.randn(1001, generator=torch.Generator().manual_seed(rank)) * 50


def _halves(numel, rank):
    """A float16 tensor of ``numel`` elements, different on every rank; at 13 elements one whose sum overflows
    float16 and, on rank 1, a NaN."""
    values = ((torch.arange(numel) % 7 - 3) * 17.3 * (rank + 1) + 0.01 * rank).to(torch.float16)
    if numel == 13:
        values[4] = 60000.0
        values[7] = float("nan") if rank == 1 else 1.0
    return values


HALF_SUM_SIZES = (0, 1, 5, 6, 13)


def _half_sums(transport):
    """Named float16 SUMs of every ``HALF_SUM_SIZES`` in flight together, advanced by ``poll`` until done (the
    windows of 3 * W elements, their last one ragged), and an unnamed one of shape [3, 4]."""
    rank = transport.rank
    handles = {numel: transport.start(Op.SUM, _halves(numel, rank), name=f"half{numel}") for numel in HALF_SUM_SIZES}
    while not all(transport.poll(handle) for handle in handles.values()):
        pass
    sums = {numel: transport.wait(handle) for numel, handle in handles.items()}
    sums["unnamed"] = transport.collective(Op.SUM, _halves(12, rank).view(3, 4))
    return sums


def _reused_sums(transport):
    """Three named SUMs of one name: the second while the first's result is held, the third once both are
    dropped. The sums (the first as it is after the second), their outputs' addresses, and the address of
    the output the transport keeps for that name after the third."""
    x = torch.arange(6.0) + transport.rank
    first = transport.wait(transport.start(Op.SUM, x, name="reused"))
    second = transport.wait(transport.start(Op.SUM, 2 * x, name="reused"))
    sums, pointers = [first.clone(), second.clone()], [first.data_ptr(), second.data_ptr()]
    del first, second
    third = transport.wait(transport.start(Op.SUM, 3 * x, name="reused"))
    return sums + [third], pointers + [third.data_ptr()], transport._sums._buffers["reused"].data_ptr()


def _alltoall_worker(transport_name):
    import hvdcomp
    from hvdcomp.exchange.protocol import drive
    from hvdcomp.transport import horovod

    transport = hvdcomp.MPITransport() if transport_name == "mpi" else hvdcomp.HorovodTransport()
    rank, size = transport.rank, transport.size
    sent = (torch.arange(4 * size) + 100 * rank).to(torch.float16)
    out = {"alltoall": transport.collective(Op.ALLTOALL, sent),
           "allgather": transport.collective(Op.ALLGATHER, sent[:3])}
    horovod.ALLTOALL_PIECE_BYTES = 6  # Horovod's all-to-alls of 8 bytes per destination in two pieces from here on
    handle = transport.start(Op.ALLTOALL, sent.view(torch.uint8), name="bytes")
    out["pieces"] = [(lo, hi) for lo, hi, _ in handle.handles] if isinstance(handle, horovod._Pieces) else None
    while not transport.poll(handle):
        pass
    out["bytes"] = transport.wait(handle)
    out["pieced"] = transport.collective(Op.ALLTOALL, sent.view(size, 4))  # 3 elements, then 1
    handle = transport.start(Op.ALLGATHER_EQUAL, sent[:4].view(2, 2), name="gather")  # 8 bytes: 3 elements, 1
    out["gather_pieces"] = [(lo, hi) for lo, hi, _ in handle.handles] if isinstance(handle, horovod._Pieces) else None
    out["gathered"] = transport.wait(handle)
    out["ragged"] = transport.collective(Op.ALLGATHER, sent[:4 + rank])  # plain: any sizes, never in pieces
    out["half_sums"] = None
    if transport_name == "horovod":  # the sum in all-to-all pieces, then Horovod's own
        out["half_sums"] = {}
        for by_horovod in (False, True):
            horovod.HOROVOD_SUMS_FLOAT16 = by_horovod
            out["half_sums"][by_horovod] = _half_sums(transport)
    out["reused"] = _reused_sums(transport) if transport_name == "horovod" else None
    codec = FP16(error_feedback=True)
    out["fp16"] = [drive(codec.exchange(_grads(rank) * (step + 1), [1001], "b", step, size), transport).clone()
                   for step in range(2)]  # the mean is the codec's buffer for "b", rewritten next step
    return out


@pytest.mark.parametrize("launcher", ["gloo", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_alltoall_and_fp16_over_real_transports(launcher):
    size = 2
    transport = "mpi" if launcher == "mpi" else "horovod"
    results = run_function(_alltoall_worker, np=size, launcher=launcher, kwargs={"transport_name": transport})
    for rank, out in enumerate(results):
        # worker r receives the r-th chunk (4 elements) of every worker's 4 * size, by rank
        want = torch.cat([(torch.arange(4 * size) + 100 * source)[4 * rank:4 * rank + 4] for source in range(size)])
        assert torch.equal(out["alltoall"], want.to(torch.float16))
        assert torch.equal(out["bytes"].view(torch.float16), want.to(torch.float16))
        assert torch.equal(out["pieced"], want.to(torch.float16).view(size, 4))
        assert out["pieces"] == (None if launcher == "mpi" else [(0, 6), (6, 8)])
        assert out["gather_pieces"] == (None if launcher == "mpi" else [(0, 3), (3, 4)])
        every = [(torch.arange(4 * size) + 100 * source).to(torch.float16) for source in range(size)]
        assert torch.equal(out["gathered"], torch.cat([sent[:4].view(2, 2) for sent in every]))
        assert torch.equal(out["ragged"], torch.cat([sent[:4 + source] for source, sent in enumerate(every)]))
        gathered = torch.cat([(torch.arange(3) + 100 * source) for source in range(size)]).to(torch.float16)
        assert torch.equal(out["allgather"], gathered)
        if launcher == "gloo":  # the sum at float32 in rank order, rounded once; Inf and NaN as they come
            for by_horovod, sums in out["half_sums"].items():
                for numel, got in sums.items():
                    parts = [_halves(12, r).view(3, 4) if numel == "unnamed" else _halves(numel, r)
                             for r in range(size)]
                    want = sum(part.float() for part in parts).half()
                    assert got.dtype == torch.float16 and torch.equal(got.isnan(), want.isnan()), (by_horovod, numel)
                    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)), (by_horovod, numel)
                assert sums[13][4] == float("inf") and sums[13][7].isnan(), by_horovod
            sums, pointers, kept = out["reused"]  # Horovod's SUM into the transport's output, reused when free
            x = sum(torch.arange(6.0) + source for source in range(size))
            assert all(torch.equal(got, k * x) for k, got in zip((1, 2, 3), sums))  # a held result never changes
            assert pointers[0] != pointers[1] and pointers[2] == kept, (pointers, kept)
    codecs = [FP16(error_feedback=True) for _ in range(size)]
    for step in range(2):
        want = simulate([codec.exchange(_grads(rank) * (step + 1), [1001], "b", step, size)
                         for rank, codec in enumerate(codecs)])[0]
        for out in results:
            assert torch.equal(out["fp16"][step], want)  # identical, bit-exactly the simulation


@pytest.mark.parametrize("version, vector_sum", [("0.28.1+hvdcomp.f16c", True), ("0.28.1", False),
                                                 ("0.28.1+other", False), (None, False)])
def test_horovod_sums_float16_itself_only_in_builds_labelled_with_gloos_vector_sum(monkeypatch, version, vector_sum):
    """``scripts/install_horovod.sh`` labels the builds whose Gloo sums float16 with F16C/AVX; only those sum
    float16 themselves (others: in all-to-all pieces summed by the transport)."""
    from hvdcomp.transport import horovod

    def installed(name):
        assert name == "horovod"
        if version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(horovod.importlib.metadata, "version", installed)
    assert horovod._gloo_sums_float16_in_vectors() is vector_sum


def test_horovod_waits_sleep_between_polls_instead_of_spinning(monkeypatch):
    """Horovod 0.28.1's ``synchronize`` spins on ``sched_yield`` until a collective is done; ``HorovodTransport``
    synchronizes a collective only once it polls done, sleeping between polls."""
    from hvdcomp.transport import horovod as transport

    polls, sleeps, synchronized = iter([False, False, True]), [], []
    monkeypatch.setattr(transport.hvd, "poll", lambda handle: next(polls))
    monkeypatch.setattr(transport.time, "sleep", sleeps.append)
    monkeypatch.setattr(transport.hvd, "synchronize", lambda handle: synchronized.append((handle, len(sleeps))) or
                        torch.ones(2))
    assert torch.equal(transport.HorovodTransport().wait(7), torch.ones(2))
    assert synchronized == [(7, 2)] and sleeps == [transport.WAIT_POLL_SECONDS] * 2
