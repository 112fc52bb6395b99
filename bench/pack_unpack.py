"""Pack / unpack throughput: flatgrad's fused kernels against the copies they replace.

The entry point of ``flatgrad/bench/pack_unpack.py``, whose docstring says what it measures and how.
"""

from flatgrad.bench.pack_unpack import main

if __name__ == "__main__":
    raise SystemExit(main())
