"""The transport layer: ``hvdcomp.exchange.protocol.Transport`` over Horovod (``HorovodTransport``)
and over mpi4py (``MPITransport``; mpi4py is imported when one is built)."""

from .horovod import HorovodTransport
from .mpi import MPITransport

__all__ = ["HorovodTransport", "MPITransport"]
