"""How close is the fused W-source unpack of the reduction modes to a plain copy?

The entry point of ``flatgrad/bench/wire_unpack.py``, whose docstring says what it measures and how.
"""

from flatgrad.bench.wire_unpack import main

if __name__ == "__main__":
    raise SystemExit(main())
