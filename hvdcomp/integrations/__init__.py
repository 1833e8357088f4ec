"""The integrations: what users call. They build on ``hvdcomp.exchange`` and ``hvdcomp.transport``.

- ``codecs``: the public max-norm codecs (``QSGDMaxNorm``, ...), bucket codecs that need no Horovod;
  ``stock``: their adapter to the stock ``hvd.DistributedOptimizer`` (loads Horovod at first use);
  ``resolve``: ``resolve_codec``, which maps ``compression=`` to a bucket codec;
- ``optimizer``: ``DistributedOptimizer``, bucketed and overlapped, optionally hierarchical;
  ``buckets``: its parameter names and buckets (Horovod's rules, ``groups``);
- ``parity``: what both optimizers share to behave like Horovod's (its warning text, its
  ``broadcast_optimizer_state`` protocol, gradient hooks that let go);
- ``birder``: ``Birder``, the 1-bit adaptive optimizer that exchanges its own updates; ``birder_state``:
  its checkpoints;
- ``launch``: ``hvdcomp.init`` and Horovod's hierarchical setting; ``warmup``: uncompressed warm-up;
  ``resume``: the optimizer's checkpoints, resuming at another world size, elastic membership changes.
- ``ddp``: the PyTorch DDP communication hook (``register``, ``CompressionState``), public as ``hvdcomp.ddp``.
"""
