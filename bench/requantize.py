"""Is the fused requantize faster than the dequantize_sum + quantize it replaces? (cpu backend by default)

The entry point of ``flatgrad/bench/requantize.py``, whose docstring says what it measures and how.
"""

from flatgrad.bench.requantize import main

if __name__ == "__main__":
    raise SystemExit(main())
