"""Pack / unpack throughput of flatgrad against its baselines (the same as ``flatgrad bench``).

The measurement lives in ``flatgrad/bench/pack_unpack.py`` so that the installed
``flatgrad bench`` command runs it too; see its docstring for the rows, the
byte counts and the timing. Examples::

    python bench/pack_unpack.py --out results.json --plot chart.png
    python bench/pack_unpack.py --quick
"""

from flatgrad.bench.pack_unpack import main

if __name__ == "__main__":
    raise SystemExit(main())
