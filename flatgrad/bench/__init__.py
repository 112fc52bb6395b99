"""Benchmarks behind ``flatgrad bench``: one module per question, each with its baselines beside it.

* ``pack_unpack``: fused pack / unpack throughput against DeepSpeed's packing,
  a per-parameter copy loop, ``torch._chunk_cat`` and a contiguous-copy roofline.
"""
