"""Calls and bytes per stage of the two-stage reductions on gloo ranks as simulated nodes, beside ``flatgrad plan``.

The measurement lives in ``flatgrad/bench/hierarchical.py``; see its docstring. Examples::

    python bench/hierarchical.py
    python bench/hierarchical.py --out hier.json
"""

from flatgrad.bench.hierarchical import main

if __name__ == "__main__":
    raise SystemExit(main())
