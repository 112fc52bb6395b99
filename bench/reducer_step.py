"""Backward + gradient reduction per step: flatgrad's BucketReducer against DDP's and stock ZeRO-2's patterns.

The entry point of ``flatgrad/bench/reducer_step.py``, whose docstring says what it measures and how.
"""

from flatgrad.bench.reducer_step import main

if __name__ == "__main__":
    raise SystemExit(main())
