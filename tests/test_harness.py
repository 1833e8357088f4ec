"""Smoke tests of the multi-process harness, and the Horovod 0.28.1 facts hvdcomp relies on.

Each launch costs seconds, so one launch checks several things: the worker functions below return what
they observed and the tests compare it here. The worker functions are pickled by value, so they run in
processes that never import this module.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import psutil
import pytest
import torch

from tests.harness import ZYGOTE, ZYGOTE_SWITCH, run_function, run_script

INT64_NEAR_2_62 = 2**62 - 1  # rank r adds this - 2 r; the sum, 2**63 - 4, is not a float64 value
INT32_BIG = 1_000_000_007
FLOAT64_WORD = 2**48 - 1  # hvdcomp carries integer words below 2**48 in float64


def _try_allreduce(x: torch.Tensor, op: Any) -> Any:
    """The all-reduce of ``x``, or ``"TypeName: message"`` if Horovod refuses it."""
    try:
        return hvd.allreduce(x, op=op)
    except Exception as e:  # the refusal is the observation
        return f"{type(e).__name__}: {e}"


def _probe_collectives() -> dict[str, Any]:
    """Worker: identity, float Sum/Max, and the dtype behaviour of all-reduce."""
    from importlib.util import find_spec

    rank = hvd.rank()
    x = torch.tensor([1.5, -2.0, 0.25]) * (rank + 1)
    return {
        "rank": rank,
        "size": hvd.size(),
        "gloo": hvd.gloo_enabled(),
        "hvdcomp_file": find_spec("hvdcomp").origin,
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "sum": hvd.allreduce(x, op=hvd.Sum),
        "max": hvd.allreduce(x, op=hvd.Max),
        "int64_sum": hvd.allreduce(torch.tensor([INT64_NEAR_2_62 - 2 * rank, -5 - rank]), op=hvd.Sum),
        "int32_sum": hvd.allreduce(torch.tensor([INT32_BIG + rank, -3], dtype=torch.int32), op=hvd.Sum),
        "int32_average": hvd.allreduce(torch.tensor([rank + 1], dtype=torch.int32), op=hvd.Average),
        "int8_sum": _try_allreduce(torch.tensor([rank + 1], dtype=torch.int8), hvd.Sum),
        "uint8_sum": _try_allreduce(torch.tensor([rank + 1], dtype=torch.uint8), hvd.Sum),
        "float_sums": {
            str(dtype): hvd.allreduce(torch.tensor([0.5, -1.25], dtype=dtype) + rank, op=hvd.Sum)
            for dtype in (torch.float16, torch.float32, torch.float64)
        },
        "float64_word_sum": hvd.allreduce(torch.tensor([FLOAT64_WORD - rank], dtype=torch.float64), op=hvd.Sum),
    }


@pytest.fixture(scope="module")
def gloo_np2() -> list[dict[str, Any]]:
    """One Gloo launch with 2 workers, shared by the tests that inspect its observations."""
    return run_function(_probe_collectives, np=2)


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, same values exactly."""
    assert actual.dtype == expected.dtype and torch.equal(actual, expected), (actual, expected)


def test_gloo_np2_basics(gloo_np2: list[dict[str, Any]]) -> None:
    repo = Path(__file__).resolve().parent.parent
    for rank, seen in enumerate(gloo_np2):
        assert (seen["rank"], seen["size"], seen["gloo"]) == (rank, 2, True)
        assert Path(seen["hvdcomp_file"]).is_relative_to(repo) and seen["omp_threads"] == "1"
        _assert_same(seen["sum"], torch.tensor([4.5, -6.0, 0.75]))
        _assert_same(seen["max"], torch.tensor([3.0, -2.0, 0.5]))


def test_gloo_np2_dtype_facts(gloo_np2: list[dict[str, Any]]) -> None:
    for seen in gloo_np2:
        # Integer Sum is exact: no float round trip even near 2**63.
        _assert_same(seen["int64_sum"], torch.tensor([2**63 - 4, -11]))
        _assert_same(seen["int32_sum"], torch.tensor([2 * INT32_BIG + 1, -6], dtype=torch.int32))
        # Average on integers divides and truncates: (1 + 2) / 2 -> 1.
        _assert_same(seen["int32_average"], torch.tensor([1], dtype=torch.int32))
        # 8-bit integers are refused outright.
        for key in ("int8_sum", "uint8_sum"):
            assert isinstance(seen[key], str) and seen[key].startswith("ValueError"), seen[key]
        for dtype in (torch.float16, torch.float32, torch.float64):
            _assert_same(seen["float_sums"][str(dtype)], torch.tensor([2.0, -1.5], dtype=dtype))
        _assert_same(seen["float64_word_sum"], torch.tensor([2 * FLOAT64_WORD - 1], dtype=torch.float64))


def test_the_installed_horovod_sums_float16_with_gloos_vector_code_where_the_cpu_has_f16c() -> None:
    """``make install`` builds Horovod with ``scripts/install_horovod.sh``, which compiles Gloo's F16C/AVX float16
    sum where the build machine has F16C and AVX, and labels the wheel for ``HorovodTransport`` to read."""
    from hvdcomp.transport import horovod

    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    assert horovod.HOROVOD_SUMS_FLOAT16 is ({"f16c", "avx"} <= set(flags)), flags


def _probe_two_nodes() -> dict[str, Any]:
    """Worker: topology as seen by every rank, and all-reduces over the world and over this node's process set."""
    me = torch.tensor([[hvd.rank(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()]])
    table = hvd.allgather(me)  # row r: rank r's view of itself
    rows = table.tolist()
    # Every rank adds the same sets in the same order: one per node (cross_rank), of that node's ranks.
    node_sets = [
        hvd.add_process_set([row[0] for row in rows if row[3] == node]) for node in sorted({row[3] for row in rows})
    ]
    mine = node_sets[hvd.cross_rank()]
    return {
        "size": hvd.size(),
        "table": table,
        "world_sum": hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum),
        "node_ranks": mine.ranks,
        "node_set_rank": mine.rank(),
        "node_sum": hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum, process_set=mine),
    }


def test_gloo_two_emulated_nodes_and_process_set() -> None:
    # Process sets must be enabled at init to be added afterwards (else add_process_set raises ValueError).
    seen = run_function(
        _probe_two_nodes, np=4, hosts="localhost:2,127.0.0.1:2", init_kwargs={"process_sets": "dynamic"}
    )
    table = seen[0]["table"]
    assert table.tolist() == [[r, r % 2, 2, r // 2, 2] for r in range(4)]  # ranks fill node 0, then node 1
    for rank, s in enumerate(seen):
        node = rank // 2
        assert s["size"] == 4 and torch.equal(s["table"], table)
        _assert_same(s["world_sum"], torch.tensor([6.0]))
        assert s["node_ranks"] == [2 * node, 2 * node + 1] and s["node_set_rank"] == rank % 2
        _assert_same(s["node_sum"], torch.tensor([float(4 * node + 1)]))


def _probe_mpi() -> dict[str, Any]:
    """Worker: Horovod's and mpi4py's view of the MPI job."""
    from mpi4py import MPI

    return {
        "rank": hvd.rank(),
        "mpi": hvd.mpi_enabled(),
        "mpi_rank": MPI.COMM_WORLD.Get_rank(),
        "mpi_size": MPI.COMM_WORLD.Get_size(),
        "sum": hvd.allreduce(torch.tensor([1.0, 2.0]) * (hvd.rank() + 1), op=hvd.Sum),
    }


@pytest.mark.mpi
def test_mpi_np2() -> None:
    pytest.importorskip("mpi4py")
    for rank, seen in enumerate(run_function(_probe_mpi, np=2, launcher="mpi")):
        assert (seen["rank"], seen["mpi"], seen["mpi_rank"], seen["mpi_size"]) == (rank, True, rank, 2)
        _assert_same(seen["sum"], torch.tensor([3.0, 6.0]))


def _fail_on_rank_1() -> int:
    """Worker: rank 1 raises, rank 0 returns normally."""
    if hvd.rank() == 1:
        raise RuntimeError("deliberate failure on rank 1")
    return hvd.rank()


def test_harness_reports_rank_failure() -> None:
    with pytest.raises(AssertionError) as info:
        run_function(_fail_on_rank_1, np=2)
    message = str(info.value)
    assert "----- rank 1 traceback -----" in message and "----- rank 0 traceback -----" not in message
    assert "in _fail_on_rank_1" in message and "RuntimeError: deliberate failure on rank 1" in message
    assert 'raise RuntimeError("deliberate failure on rank 1")' in message  # source lines despite cloudpickle
    assert "no result from ranks [1]" in message and "----- launcher output" in message


def _sleep_forever(pid_dir: str) -> None:
    """Worker: record this process's pid, then outlive any sane timeout."""
    Path(pid_dir, f"{hvd.rank()}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (an unreaped zombie counts as dead)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_harness_enforces_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match="timed out after 10 s"):
        run_function(_sleep_forever, np=2, kwargs={"pid_dir": str(tmp_path)}, timeout=10)
    assert time.monotonic() - start < 30
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and not any(_running(pid) for pid in pids)


def test_run_script_passes_args_and_returns_output(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(
        "import sys\n"
        "import horovod.torch as hvd\n"
        "import torch\n"
        "hvd.init()\n"
        "total = hvd.allreduce(torch.tensor([float(sys.argv[1]) * (hvd.rank() + 1)]), op=hvd.Sum)\n"
        "print(f'rank {hvd.rank()} of {hvd.size()} total {total.item()} argv {sys.argv[2:]}')\n"
    )
    output = run_script(script, np=2, args=["1.5", "--flag"], timeout=60).stdout
    for rank in range(2):
        assert f"rank {rank} of 2 total 4.5 argv ['--flag']" in output


def _parent_command() -> list[str]:
    """Worker: the command line of this process's parent."""
    return psutil.Process().parent().cmdline()


@pytest.mark.parametrize("launcher", ["gloo", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_workers_fork_from_the_zygote_unless_switched_off(launcher: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for parent in run_function(_parent_command, np=2, launcher=launcher):
        assert str(ZYGOTE) in parent and "serve" in parent, parent
    monkeypatch.setenv(ZYGOTE_SWITCH, "0")
    for parent in run_function(_parent_command, np=2, launcher=launcher):
        assert str(ZYGOTE) not in parent, parent


def _killed_then_terminated(marker_dir: str) -> None:
    """Worker: every rank notes a SIGTERM in ``marker_dir`` and exits; then rank 1 dies of SIGKILL and the others
    wait for horovodrun's SIGTERM."""
    def on_term(*_: Any) -> None:
        Path(marker_dir, f"terminated.{hvd.rank()}").write_text("")
        os._exit(3)

    signal.signal(signal.SIGTERM, on_term)
    hvd.barrier()
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


@pytest.mark.parametrize("zygote", ["1", "0"])
def test_signals_and_exit_statuses_reach_horovodrun(zygote: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the zygote as without it: horovodrun sees a worker killed by SIGKILL as 137, and its SIGTERM
    reaches the other worker's handler. (Whether horovodrun prints that worker's own exit code is a race in
    horovodrun, so it is not checked.)"""
    monkeypatch.setenv(ZYGOTE_SWITCH, zygote)
    with pytest.raises(AssertionError) as info:
        run_function(_killed_then_terminated, np=2, kwargs={"marker_dir": str(tmp_path)}, timeout=60)
    assert "Process 1 exit with status code 137." in str(info.value), str(info.value)
    assert [p.name for p in tmp_path.iterdir()] == ["terminated.0"]
