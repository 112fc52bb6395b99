"""How large is each reduction mode's error on real gradients? One reduction, against the fp64 sum.

The entry point of ``flatgrad/bench/reduction_error.py``, whose docstring says what it measures and how.
"""

from flatgrad.bench.reduction_error import main

if __name__ == "__main__":
    raise SystemExit(main())
