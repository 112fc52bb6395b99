"""Bytes still live when ``engine.step()`` returns that gloo's worker threads free a few milliseconds later.

The entry point of ``flatgrad/bench/late_frees.py``, whose docstring says what it measures and how.
"""

from flatgrad.bench.late_frees import main

if __name__ == "__main__":
    raise SystemExit(main())
