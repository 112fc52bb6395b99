"""Memory per rank, stock DeepSpeed against flatgrad: ZeRO-1, ZeRO-2 and ZeRO-3, fp32 and bf16, W = 2 and 4.

The entry point of ``flatgrad/bench/memory.py``, whose docstring says what it measures and how.
"""

from flatgrad.bench.memory import main

if __name__ == "__main__":
    raise SystemExit(main())
