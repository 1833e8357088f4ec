"""The integrations: what users call. They build on ``hvdcomp.exchange`` and ``hvdcomp.transport``.

- ``compressors``: Horovod ``Compressor`` objects for the stock ``hvd.DistributedOptimizer``
  (``QSGDMaxNorm``, ...) and ``bucket_codec``, which maps ``compression=`` to a bucket codec;
- ``optimizer``: ``DistributedOptimizer``, bucketed and overlapped, optionally hierarchical;
- ``birder``: ``Birder``, the 1-bit adaptive optimizer that exchanges its own updates.
"""
