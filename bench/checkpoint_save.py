"""Checkpoint saves per rank, stock DeepSpeed against flatgrad in its own layout and in stock's: ZeRO-1/2, fp32.

The entry point of ``flatgrad/bench/checkpoint_save.py``, whose docstring says what it measures and how.
"""

from flatgrad.bench.checkpoint_save import main

if __name__ == "__main__":
    raise SystemExit(main())
