"""hvdcomp on PyTorch FSDP2: the element-wise codecs as FSDP's reduce-scatter, without Horovod.

    import hvdcomp.fsdp
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = hvdcomp.fsdp.register(model, hvdcomp.QSGDMaxNorm(8))   # or FP16(), NoCompression(), ...
    ...                                                              # train as usual
    state.stats.last_step, state.state_dict(), state.load_state_dict(...), state.close()

HSDP: shard with ``fully_shard(..., mesh=mesh["shard"])`` and pass the 2-D mesh, ``register(model, codec,
mesh=mesh)``: full precision inside the shard group, the codec across replicas. ``register`` and
``FSDPCompressionState`` are ``hvdcomp.integrations.fsdp``'s. Importing this module imports neither Horovod nor
mpi4py.
"""

from .integrations.fsdp import FSDPCompressionState, register

__all__ = ["FSDPCompressionState", "register"]
