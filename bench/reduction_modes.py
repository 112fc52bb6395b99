"""Does a reduction mode change training? Loss curves of ZeRO-2 under each ``flatgrad.reduction``.

The entry point of ``flatgrad/bench/reduction_modes.py``, whose docstring says what it measures and how.
"""

from flatgrad.bench.reduction_modes import main

if __name__ == "__main__":
    raise SystemExit(main())
