"""ZeRO-3 reduce path per optimizer step: stock DeepSpeed against flatgrad, in one run.

The entry point of ``flatgrad/bench/zero3_reduce.py``, whose docstring says what it measures and how.
"""

from flatgrad.bench.zero3_reduce import main

if __name__ == "__main__":
    raise SystemExit(main())
