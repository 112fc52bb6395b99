"""ZeRO-2 backward + reduction and step: stock DeepSpeed (both reduce modes) against flatgrad, in one run.

The entry point of ``flatgrad/bench/zero_step.py``, whose docstring says what it measures and how.
"""

from flatgrad.bench.zero_step import main

if __name__ == "__main__":
    raise SystemExit(main())
