"""Worker entry point started by ``tests/harness.py`` under horovodrun or mpirun (not a test module).

``python _worker_runner.py JOBDIR``: load ``(fn, kwargs, init_kwargs, init, source_file)`` from
``JOBDIR/payload.pkl``, call ``hvd.init(**init_kwargs)`` (``hvdcomp.init`` if ``init`` is ``"hvdcomp"``) and
``fn(**kwargs)``, write the result to ``JOBDIR/result.<rank>.pkl``.

``python _worker_runner.py JOBDIR SCRIPT [ARGS...]``: run SCRIPT as ``__main__`` with ``sys.argv``
``[SCRIPT, *ARGS]`` (the script calls ``hvd.init()`` itself).

On an exception (or a non-zero ``SystemExit``) the traceback goes to ``JOBDIR/error.<rank>.txt`` and
the exception propagates, so the process exits non-zero.
"""

from __future__ import annotations

import linecache
import os
import runpy
import sys
import traceback
from pathlib import Path

import cloudpickle


def _launcher_rank() -> str:
    """This process's rank as set by horovodrun (Gloo) or Open MPI's mpirun, before ``hvd.init``."""
    return os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1"))


def _run_function(jobdir: Path) -> None:
    import horovod.torch as hvd

    fn, kwargs, init_kwargs, init, source = cloudpickle.loads((jobdir / "payload.pkl").read_bytes())
    if source:  # cloudpickle names by-value code "<dynamic-code>"; let tracebacks show fn's module source
        linecache.cache["<dynamic-code>"] = (None, None, Path(source).read_text().splitlines(True), source)
    if init == "hvdcomp":
        import hvdcomp

        hvdcomp.init(**init_kwargs)
    else:
        hvd.init(**init_kwargs)
    result = cloudpickle.dumps(fn(**kwargs))
    tmp = jobdir / f".result.{hvd.rank()}.pkl"
    tmp.write_bytes(result)
    os.replace(tmp, jobdir / f"result.{hvd.rank()}.pkl")
    # A worker that exits while another node still finishes a node-local collective shuts Horovod down
    # under it: leave together. If another rank failed, the barrier fails too; that rank reports it.
    try:
        hvd.barrier()
    except RuntimeError:
        pass


def _run_script(script: Path, args: list[str]) -> None:
    sys.argv = [str(script), *args]
    sys.path[0] = str(script.parent)
    runpy.run_path(str(script), run_name="__main__")


def main() -> None:
    jobdir = Path(sys.argv[1])
    try:
        if len(sys.argv) > 2:
            _run_script(Path(sys.argv[2]), sys.argv[3:])
        else:
            _run_function(jobdir)
    except BaseException as e:
        if not (isinstance(e, SystemExit) and e.code in (None, 0)):
            (jobdir / f"error.{_launcher_rank()}.txt").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
