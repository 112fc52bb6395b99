"""How close is the fused W-source unpack to a plain copy? (see ``flatgrad/bench/wire_unpack.py``)

    python bench/wire_unpack.py --numel 4194304 --world 4 --threads 1
"""

from __future__ import annotations

import sys

from flatgrad.bench.wire_unpack import main

if __name__ == "__main__":
    sys.exit(main())
