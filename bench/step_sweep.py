"""The optimizer step against the number of ZeRO-1/2 sub-groups: does its cost grow with them?

The entry point of ``flatgrad/bench/step_sweep.py``, whose docstring says what it measures and how.
"""

from flatgrad.bench.step_sweep import main

if __name__ == "__main__":
    raise SystemExit(main())
