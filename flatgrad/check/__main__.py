"""``python -m flatgrad.check``: the same as ``flatgrad check``."""

from .command import main

raise SystemExit(main())
