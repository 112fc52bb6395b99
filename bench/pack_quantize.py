"""Is the fused pack-quantize at least as fast as the pack + quantize it replaces? (cpu backend by default)

The entry point of ``flatgrad/bench/pack_quantize.py``, whose docstring says what it measures and how.
"""

from flatgrad.bench.pack_quantize import main

if __name__ == "__main__":
    raise SystemExit(main())
