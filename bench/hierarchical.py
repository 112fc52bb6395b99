"""Calls and bytes per stage of the two-stage reductions on real gloo ranks, beside what ``flatgrad plan`` models.

The entry point of ``flatgrad/bench/hierarchical.py``, whose docstring says what it measures and how.
"""

from flatgrad.bench.hierarchical import main

if __name__ == "__main__":
    raise SystemExit(main())
