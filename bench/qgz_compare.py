"""flatgrad's qgZ against DeepSpeed's ZeRO++ qgZ: error and bytes per rank, on the CPU (stock's error: GPU-only).

The entry point of ``flatgrad/bench/qgz_compare.py``, whose docstring says what it measures and how.
"""

from flatgrad.bench.qgz_compare import main

if __name__ == "__main__":
    raise SystemExit(main())
