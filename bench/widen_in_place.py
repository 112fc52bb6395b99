"""What does widening a bit16 delivery inside its fp32 host target cost, against a cast from a separate buffer?

The entry point of ``flatgrad/bench/widen_in_place.py``, whose docstring says what it measures and how.
"""

from flatgrad.bench.widen_in_place import main

if __name__ == "__main__":
    raise SystemExit(main())
