"""Run real multi-process Horovod jobs from pytest.

``run_function`` ships a function by value (cloudpickle) to N workers started by a launcher, calls
``hvd.init(**init_kwargs)`` then ``fn(**kwargs)`` in each, and returns the per-rank results ordered by
``hvd.rank()``; ``run_elastic`` does the same for a Horovod elastic job (host discovery script).
``run_script`` runs a standalone script under the same launchers. All raise ``AssertionError`` on any
failure (non-zero exit, timeout, a rank raising, a missing result), showing every rank's traceback and
the tail of the launcher's combined stdout/stderr.

Launchers:

* ``"gloo"``: ``horovodrun --gloo -np N [-H hosts]``. With ``hosts`` such as ``"localhost:2,127.0.0.1:2"``
  the two names count as two nodes (local_size 2, cross_size 2). Gloo starts one worker per slot in
  ``-H`` whatever ``-np`` says, so ``np`` must equal the number of slots. horovodrun's own entry point runs
  in a process forked from pytest (``_ForkedHorovodrun``), which saves its 2.3 s check that Gloo is built.
* ``"mpi"``: ``mpirun --allow-run-as-root --oversubscribe --tag-output --bind-to none -np N [-H hosts]``
  directly, not ``horovodrun --mpi`` (which builds a similar mpirun line but adds ~3 s of start-up per
  launch). Local ranks inherit the environment, so no ``-x`` is needed.
  Open MPI treats ``127.0.0.1`` as this host and Horovod derives local ranks from shared memory, so
  emulated nodes are not possible under MPI: every rank is on one node.

Under both, the command the launcher runs per worker is the client of a zygote (``tests/_zygote.py``): the
worker is forked from a process of this session that has torch, ``torch._dynamo``, ``horovod.torch`` and
hvdcomp imported (about 3 to 5 s of CPU saved per worker on 2 cores), and otherwise gets what the launcher
gives it (argv, environment, stdio, signals, exit status); it initialises Horovod (and MPI) itself.
``HVDCOMP_TEST_ZYGOTE=0`` starts every worker as a fresh interpreter instead.
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings
from pathlib import Path
from typing import Any, Callable

import cloudpickle
import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).resolve().parent / "_worker_runner.py"
ZYGOTE = Path(__file__).resolve().parent / "_zygote.py"
ZYGOTE_SWITCH = "HVDCOMP_TEST_ZYGOTE"
ZYGOTE_PIDS = "HVDCOMP_ZYGOTE_PIDS"  # tests/_zygote.py: where its clients record their workers' pids
ZYGOTE_START_SECONDS = 120
OUTPUT_TAIL_LINES = 200
LAUNCHERS = ("gloo", "mpi")


def run_function(
    fn: Callable[..., Any],
    np: int = 2,
    hosts: str | None = None,
    launcher: str = "gloo",
    kwargs: dict[str, Any] | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    init_kwargs: dict[str, Any] | None = None,
    init: str = "horovod",
) -> list[Any]:
    """Run ``fn(**kwargs)`` on ``np`` Horovod workers; return the results ordered by ``hvd.rank()``.

    ``init_kwargs`` go to ``hvd.init`` (e.g. ``{"process_sets": "dynamic"}``), or to ``hvdcomp.init`` with
    ``init="hvdcomp"``. Results travel back
    through pickle files, so tensors compare exactly; return plain data and tensors, not instances of
    classes defined in the test module (those come back as copies of a by-value class).
    """
    if init not in ("horovod", "hvdcomp"):
        raise ValueError(f"init must be 'horovod' or 'hvdcomp', got {init!r}")
    with tempfile.TemporaryDirectory(prefix="hvdcomp-harness-") as tmp:
        cmd = _launcher_command(launcher, np, hosts)
        return _run_payload(fn, kwargs, init_kwargs, init, cmd, Path(tmp), timeout, env, expected=np)[0]


def _run_payload(fn: Callable[..., Any], kwargs: dict[str, Any] | None, init_kwargs: dict[str, Any] | None, init: str,
                 launcher_cmd: list[str], jobdir: Path, timeout: float, env: dict[str, str] | None,
                 expected: int | None) -> tuple[list[Any], str]:
    """Ship ``fn`` to the workers ``launcher_cmd`` starts; return (results by rank, launcher output). Every
    rank below ``expected`` (or below the number of results, if None) must have returned one."""
    source = getattr(getattr(fn, "__code__", None), "co_filename", None)
    source = source if source and os.path.isfile(source) else None
    payload = (fn, kwargs or {}, init_kwargs or {}, init, source)
    (jobdir / "payload.pkl").write_bytes(_dumps_by_value(fn, payload))
    cmd = launcher_cmd + _python() + [str(RUNNER), str(jobdir)]
    returncode, output = _launch(cmd, jobdir, timeout, env)
    results = {int(p.name.split(".")[1]): p for p in jobdir.glob("result.*.pkl")}
    missing = sorted(set(range(len(results) if expected is None else expected)) - set(results))
    what = f"run_function({getattr(fn, '__qualname__', fn)!r}{f' from {source}' if source else ''})"
    _check(what, cmd, returncode, timeout, output, jobdir, missing)
    values = []
    for rank in sorted(results):
        with open(results[rank], "rb") as f:
            values.append(pickle.load(f))
    return values, output


def run_elastic(
    fn: Callable[..., Any],
    np: int,
    min_np: int,
    discovery_script: str,
    kwargs: dict[str, Any] | None = None,
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> tuple[list[Any], str]:
    """Run ``fn(**kwargs)`` as a Horovod elastic job: ``horovodrun --gloo -np np --min-np min_np
    --host-discovery-script S``, ``S`` a bash script with the body ``discovery_script`` (it prints
    ``host:slots`` lines and may read files the workers write). ``fn`` runs after ``hvd.init()`` and
    drives ``hvd.elastic.run`` itself. Returns the results of the workers that finished, ordered by their
    final ``hvd.rank()``, and the launcher's output."""
    with tempfile.TemporaryDirectory(prefix="hvdcomp-harness-") as tmp:
        jobdir = Path(tmp)
        script = jobdir / "discover.sh"
        script.write_text("#!/bin/bash\n" + discovery_script)
        script.chmod(0o755)
        cmd = _launcher_command("gloo", np, None)
        cmd += ["--min-np", str(min_np), "--host-discovery-script", str(script)]
        return _run_payload(fn, kwargs, {}, "horovod", cmd, jobdir, timeout, env, expected=None)


def run_script(
    path: str | os.PathLike[str],
    np: int = 2,
    hosts: str | None = None,
    launcher: str = "gloo",
    args: tuple[str, ...] | list[str] = (),
    timeout: float = 300,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python path *args`` on ``np`` workers; return the launcher's combined output as ``stdout``.

    The script calls ``hvd.init()`` itself. It runs as ``__main__`` inside the worker runner, which
    records each rank's traceback if the script raises.
    """
    with tempfile.TemporaryDirectory(prefix="hvdcomp-harness-") as tmp:
        jobdir = Path(tmp)
        script = Path(path).resolve()
        cmd = _launcher_command(launcher, np, hosts) + _python() + [
            str(RUNNER),
            str(jobdir),
            str(script),
            *map(str, args),
        ]
        returncode, output = _launch(cmd, jobdir, timeout, env)
        _check(f"run_script({script.name!r})", cmd, returncode, timeout, output, jobdir, missing=[])
        return subprocess.CompletedProcess(cmd, 0, stdout=output)


def _worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for workers: the current one, single-threaded, unbuffered, with the repo importable."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONHASHSEED="0",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    env.update(extra or {})
    return env


def _dumps_by_value(fn: Callable[..., Any], obj: Any) -> bytes:
    """cloudpickle ``obj`` with ``fn``'s module pickled by value, so workers need not import it."""
    name = getattr(fn, "__module__", None)
    module = sys.modules.get(name) if name else None
    register = module is not None and name != "__main__" and name not in cloudpickle.list_registry_pickle_by_value()
    if register:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(obj)
    finally:
        if register:
            cloudpickle.unregister_pickle_by_value(module)


def _slots(hosts: str) -> int:
    """Total slots in a ``-H`` list such as ``"localhost:2,127.0.0.1:2"`` (a bare name is one slot)."""
    return sum(int(h.rpartition(":")[2]) if ":" in h else 1 for h in hosts.split(",") if h)


def _launcher_command(launcher: str, np: int, hosts: str | None) -> list[str]:
    """The launcher's argv up to (not including) the python command."""
    host_args = ["-H", hosts] if hosts else []
    if launcher == "gloo":
        if hosts and _slots(hosts) != np:
            raise ValueError(f"Gloo starts one worker per slot: np={np} but hosts={hosts!r} has {_slots(hosts)}")
        return [str(Path(sys.executable).parent / "horovodrun"), "--gloo", "-np", str(np), *host_args]
    if launcher == "mpi":
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            raise RuntimeError("launcher='mpi' needs mpirun on PATH")
        flags = "--allow-run-as-root --oversubscribe --tag-output --bind-to none".split()
        return [mpirun, *flags, "-np", str(np), *host_args]
    raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")


class _Zygote:
    """This session's worker zygote (``tests/_zygote.py``): started at the first launch, stopped at exit."""

    process: subprocess.Popen | None = None
    socket: str | None = None
    failed = False


def _zygote_socket() -> str | None:
    """The socket of a running zygote, started now if needed; None where switched off or it failed to start
    (one warning, then workers start as fresh interpreters)."""
    if os.environ.get(ZYGOTE_SWITCH, "1") == "0" or _Zygote.failed:
        return None
    if _Zygote.process is not None and _Zygote.process.poll() is None:
        return _Zygote.socket
    home = Path(tempfile.mkdtemp(prefix="hvdcomp-zygote-"))
    atexit.register(shutil.rmtree, home, True)
    with open(home / "log", "wb") as log:
        process = subprocess.Popen([sys.executable, str(ZYGOTE), "serve", str(home / "socket")], env=_worker_env(),
                                   cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log)
    atexit.register(process.terminate)  # it kills its workers
    ready = select.select([process.stdout], [], [], ZYGOTE_START_SECONDS)[0]
    if not ready or process.stdout.readline() != b"ready\n":
        process.kill()
        _Zygote.failed = True
        warnings.warn(f"tests/_zygote.py did not start; workers start as fresh interpreters. Its log: "
                      f"{(home / 'log').read_text(errors='replace')[-2000:]}", RuntimeWarning, stacklevel=3)
        return None
    _Zygote.process, _Zygote.socket = process, str(home / "socket")
    return _Zygote.socket


def _python() -> list[str]:
    """How the launcher starts Python for a worker: through the zygote's client where it runs, else
    ``sys.executable``."""
    socket = _zygote_socket()
    return [sys.executable, "-I", "-S", str(ZYGOTE), "connect", socket] if socket else [sys.executable]


class _ForkedHorovodrun:
    """``horovodrun ARGS`` as a child of this process, which has ``horovod.torch`` (so torch) imported.

    horovodrun first checks that Gloo is built by importing ``horovod.torch`` in a forked child: 2.3 s in a
    fresh interpreter, every launch, before a worker starts. Forked from here, its entry point
    (``horovod.runner.launch.run_commandline``, all the ``horovodrun`` script runs) finds the module loaded.
    The child leads its own session and writes to ``log``; ``wait`` and ``pid`` behave as ``subprocess.Popen``'s."""

    def __init__(self, args: list[str], log: Any, env: dict[str, str]) -> None:
        import horovod.torch  # noqa: F401 (loaded before the fork: see the class docstring)
        from horovod.runner.launch import run_commandline

        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            if stream is not None:
                stream.flush()  # nothing buffered here is written twice by the child
        self.returncode: int | None = None
        self.pid = os.fork()
        if self.pid:
            return
        code = 1
        try:  # the child: never returns into pytest
            os.setsid()
            os.chdir(REPO_ROOT)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            os.environ.clear()
            os.environ.update(env)
            sys.argv = ["horovodrun", *args]
            # horovodrun spawns (multiprocessing "spawn") a middleman per worker, which would re-import the
            # __main__ module of this process (pytest's): give it an empty one, as the horovodrun script's is
            sys.modules["__main__"] = types.ModuleType("__main__")
            run_commandline()
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        except BaseException:  # noqa: BLE001 (an uncaught error exits horovodrun with 1, its traceback shown)
            import traceback

            traceback.print_exc()
        finally:  # as the interpreter's exit would: wait for horovodrun's threads (they report the workers' exits)
            for thread in threading.enumerate():
                if thread is not threading.current_thread() and not thread.daemon:
                    thread.join()
            sys.stdout.flush()
            os._exit(code)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, 0 if deadline is None else os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["horovodrun"], timeout)
            else:
                time.sleep(0.05)
        return self.returncode


def _launch(cmd: list[str], jobdir: Path, timeout: float, env: dict[str, str] | None) -> tuple[int | None, str]:
    """Run ``cmd`` in its own session; return (exit code or None on timeout, combined output). horovodrun runs
    forked from this process (``_ForkedHorovodrun``), anything else (mpirun) as a new process."""
    log_path = jobdir / "launcher.log"
    with open(log_path, "wb") as log:
        env = {**(env or {}), ZYGOTE_PIDS: str(jobdir)}
        if Path(cmd[0]).name == "horovodrun":
            proc: Any = _ForkedHorovodrun(cmd[1:], log, _worker_env(env))
        else:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=_worker_env(env), cwd=REPO_ROOT, start_new_session=True)
        try:
            returncode: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc, jobdir)
            returncode = None
        except BaseException:  # e.g. Ctrl-C in pytest: the launcher's own session would not see it
            _kill_tree(proc, jobdir)
            raise
    return returncode, log_path.read_text(errors="replace")


def _kill_tree(proc: Any, jobdir: Path) -> None:
    """SIGKILL the launcher's process group, every descendant and the workers forked for it by the zygote
    (their pids recorded in ``jobdir``), then wait (10 s at most) until all are dead.

    Descendants are listed first because horovodrun's per-worker middleman calls ``setsid()``, so the
    workers are not in the launcher's process group.
    """
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for path in jobdir.glob("worker.*"):
        try:
            worker = psutil.Process(int(path.name.split(".")[1]))
            if _Zygote.process is not None and worker.ppid() == _Zygote.process.pid:  # not a reused pid
                tree.append(worker)
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.05)


def _alive(p: psutil.Process) -> bool:
    """Whether ``p`` still runs (a zombie awaiting its reaper counts as dead)."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _check(
    what: str,
    cmd: list[str],
    returncode: int | None,
    timeout: float,
    output: str,
    jobdir: Path,
    missing: list[int],
) -> None:
    """Raise AssertionError with every rank's traceback and the output tail if the launch failed."""
    errors = sorted(jobdir.glob("error.*.txt"), key=lambda p: int(p.name.split(".")[1]))
    if returncode == 0 and not errors and not missing:
        return
    status = f"timed out after {timeout} s" if returncode is None else f"launcher exit code {returncode}"
    parts = [f"{what} failed: {status}", "command: " + " ".join(cmd)]
    if missing:
        parts.append(f"no result from ranks {missing}")
    for path in errors:
        parts.append(f"----- rank {path.name.split('.')[1]} traceback -----\n{path.read_text().rstrip()}")
    lines = output.splitlines()
    cut = f" (last {OUTPUT_TAIL_LINES} of {len(lines)} lines)" if len(lines) > OUTPUT_TAIL_LINES else ""
    parts.append(f"----- launcher output{cut} -----\n" + "\n".join(lines[-OUTPUT_TAIL_LINES:]))
    raise AssertionError("\n".join(parts))
