"""A worker "zygote" for ``tests/harness.py``: workers forked from a process with torch already imported.

A worker's ``import torch, horovod.torch`` and its first torch optimizer (which imports ``torch._dynamo``)
cost 3 to 5 s of CPU on a 2-core machine, most of a small multi-process test. ``harness`` starts one zygote
per pytest session (``python _zygote.py serve SOCKET``), which imports all of that and hvdcomp, then waits.
The launcher (horovodrun or mpirun) still starts every worker; the command it runs is the client (``python
-I -S _zygote.py connect SOCKET SCRIPT ARGS...``, stdlib only, a few ms), which hands the zygote its argv,
environment, working directory and stdin / stdout / stderr. The zygote forks a worker that takes all of
these, leads a session of its own, and runs ``SCRIPT`` as ``__main__``: a process like one the launcher
starts, without the imports. Neither Horovod nor MPI is initialised before the fork, and the zygote runs a
single thread.

The client stands in for the worker towards the launcher: signals it receives go to the worker, and it exits
with the worker's status (killed by the same signal where the worker was). If the client dies (horovodrun's
SIGKILL), the zygote kills the worker's process group. The zygote sends the worker's pid first; the client
writes it to ``$HVDCOMP_ZYGOTE_PIDS/worker.<pid>`` where that is set, so the harness can kill workers of a
launch it abandons. The zygote exits when its parent (pytest) does, killing its workers.

Wire (``AF_UNIX``, ``SOCK_SEQPACKET``): client -> zygote one pickled ``(argv, environ, cwd)`` with fds 0, 1,
2, then one int32 per forwarded signal; zygote -> client the worker's pid, then its ``waitpid`` status
(int32 each).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import struct
import sys

_INT = struct.Struct("i")
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
PIDS_DIR_VARIABLE = "HVDCOMP_ZYGOTE_PIDS"
_REQUEST_BYTES = 1 << 20


def connect(path: str, argv: list[str]) -> None:
    """The client: have the zygote at ``path`` run ``argv`` as this process would; exit as it exits."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    socket.send_fds(sock, [pickle.dumps((argv, dict(os.environ), os.getcwd()))], [0, 1, 2])
    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, lambda signum, _frame: sock.send(_INT.pack(signum)))
    pid = _receive_int(sock)
    pids_dir = os.environ.get(PIDS_DIR_VARIABLE)
    if pids_dir:
        open(os.path.join(pids_dir, f"worker.{pid}"), "w").close()
    code = os.waitstatus_to_exitcode(_receive_int(sock))
    if code < 0:  # killed by a signal: be killed by it too
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # (those two cannot be caught)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def _receive_int(sock: socket.socket) -> int:
    reply = sock.recv(_INT.size)
    if len(reply) != _INT.size:
        sys.stderr.write("hvdcomp test zygote: the zygote went away\n")
        os._exit(1)
    return _INT.unpack(reply)[0]


class _Worker:
    """A forked worker: its client's connection (None once the client is gone) and a pidfd to reap it."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self.conn: socket.socket | None = conn
        self.pid = pid
        self.pidfd = os.pidfd_open(pid)

    def kill_group(self) -> None:
        """SIGKILL the worker's process group (the worker itself, should it not lead one yet)."""
        for kill in (os.killpg, os.kill):
            try:
                kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _preload() -> None:
    """Import what most workers import: torch, ``torch._dynamo`` (loaded by a torch optimizer's first
    construction: about 1.7 s of CPU), ``horovod.torch``, every hvdcomp module, and the runner's modules."""
    import importlib
    import pkgutil

    import cloudpickle  # noqa: F401 (tests/_worker_runner.py)
    import horovod.torch  # noqa: F401
    import psutil  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401

    import hvdcomp

    for module in pkgutil.walk_packages(hvdcomp.__path__, "hvdcomp."):
        importlib.import_module(module.name)


def serve(path: str) -> None:
    """The zygote: preload, listen at ``path``, fork one worker per client until the parent exits."""
    _preload()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    workers: list[_Worker] = []
    signal.signal(signal.SIGTERM, lambda *_: _stop(workers))
    print("ready", flush=True)
    while True:
        if os.getppid() != parent:
            _stop(workers)
        conns = [w.conn for w in workers if w.conn is not None]
        ready = select.select([listener, *conns, *(w.pidfd for w in workers)], [], [], 1.0)[0]
        if listener in ready:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, _REQUEST_BYTES, 3)
            if not message or len(fds) != 3:  # a client that died before its request
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _become_worker(pickle.loads(message), fds, [listener, conn, *conns, *(w.pidfd for w in workers)])
            for fd in fds:
                os.close(fd)
            workers.append(_Worker(conn, pid))
            _send(conn, pid)  # a client already gone shows as end of file below
        for worker in list(workers):
            if worker.conn is not None and worker.conn in ready:
                try:
                    data = worker.conn.recv(_INT.size)
                except OSError:
                    data = b""
                if len(data) == _INT.size:
                    os.kill(worker.pid, _INT.unpack(data)[0])
                else:  # the client died (horovodrun's SIGKILL, or the harness's)
                    worker.kill_group()
                    worker.conn.close()
                    worker.conn = None
            if worker.pidfd in ready:
                _, status = os.waitpid(worker.pid, 0)
                if worker.conn is not None:
                    _send(worker.conn, status)
                    worker.conn.close()
                os.close(worker.pidfd)
                workers.remove(worker)


def _send(conn: socket.socket, value: int) -> None:
    try:
        conn.send(_INT.pack(value))
    except OSError:  # the client is gone
        pass


def _stop(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.kill_group()
    os._exit(0)


def _become_worker(request: tuple[list[str], dict[str, str], str], fds: list[int], inherited: list) -> None:
    """In the forked child: take the client's argv, environment, directory and stdio; run the script; exit as
    the interpreter does after it (atexit handlers, non-daemon threads), by letting ``SystemExit`` or the
    script's exception propagate."""
    import random
    import runpy

    argv, environ, cwd = request
    for item in inherited:
        item.close() if isinstance(item, socket.socket) else os.close(item)
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    random.seed()
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    extra = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra
    runpy.run_path(argv[0], run_name="__main__")
    raise SystemExit(0)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        connect(sys.argv[2], sys.argv[3:])
