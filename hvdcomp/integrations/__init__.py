"""The integrations: what users call, thin doors onto ``hvdcomp.exchange.runner.Runner`` and
``hvdcomp.exchange.state.ExchangeState``; each says when a bucket is ready and where its means go.

- ``codecs``: the public max-norm codecs (``QSGDMaxNorm``, ...), bucket codecs that need no Horovod;
  ``stock``: their adapter to the stock ``hvd.DistributedOptimizer`` (loads Horovod at first use);
  ``resolve``: ``resolve_codec``, which maps ``compression=`` to a bucket codec;
- ``optimizer``: ``DistributedOptimizer``, bucketed and overlapped, optionally hierarchical;
  ``buckets``: its parameter names and order (Horovod's rules);
- ``parity``: what the optimizers share to behave like Horovod's (its warning text, gradient hooks that let
  go, one codec per optimizer);
- ``birder``: ``Birder``, the 1-bit adaptive optimizer that exchanges its own updates; ``birder_state``:
  its checkpoints;
- ``launch``: ``hvdcomp.init`` and Horovod's hierarchical setting; ``warmup``: the stock path's gradients sent
  uncompressed (warm-up, small gradients).
- ``ddp``: the PyTorch DDP communication hook (``register``, ``hook``, ``CompressionState``), public as ``hvdcomp.ddp``;
- ``fsdp``: FSDP2's compressed reduce-scatter (``register``, ``FSDPCompressionState``), public as ``hvdcomp.fsdp``.
"""
