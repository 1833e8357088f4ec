"""hvdcomp on PyTorch DDP: the same codecs as a DDP communication hook, without Horovod.

    import hvdcomp.ddp

    model = torch.nn.parallel.DistributedDataParallel(model)
    state = hvdcomp.ddp.register(model, hvdcomp.PowerSGD(rank=1))   # or hvdcomp.QSGDMaxNorm(8), BF16(), ...
    ...                                                               # train as usual; no_sync works
    state.stats.last_step, state.state_dict(), state.load_state_dict(...)

    state, hook = hvdcomp.ddp.hook(hvdcomp.QSGDMaxNorm(4))            # torch's convention, for trainers that take
    model.register_comm_hook(state, hook)                             # a hook (Lightning's DDPStrategy)

``register``, ``hook`` and ``CompressionState`` are ``hvdcomp.integrations.ddp``'s; ``resolve_codec``
(``hvdcomp.integrations.resolve``) says which bucket codec a ``compression`` argument runs;
``TorchDistributedTransport`` (``hvdcomp.transport.torch_distributed``) also carries ``hvdcomp.Birder``'s
exchange on DDP-launched processes: ``Birder(params, lr=..., transport=TorchDistributedTransport())``.
Importing this module imports neither Horovod nor mpi4py.
"""

from .integrations.ddp import CompressionState, compression_hook, hook, register
from .integrations.resolve import resolve_codec
from .transport.torch_distributed import TorchDistributedTransport

__all__ = ["CompressionState", "TorchDistributedTransport", "compression_hook", "hook", "register", "resolve_codec"]
