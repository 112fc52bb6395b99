"""The benches: one module per question, each with its baselines beside it; ``bench/<name>.py`` runs ``main()``.

Every bench's code lives here, where it is imported and tested; ``bench/`` holds thin entry points only
(see "Measuring" in docs/design.md). ``flatgrad bench`` runs ``pack_unpack``, the fused pack / unpack
throughput against DeepSpeed's packing, a per-parameter copy loop, ``torch._chunk_cat`` and a
contiguous-copy roofline.
"""
