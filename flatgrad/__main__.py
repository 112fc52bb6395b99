"""``python -m flatgrad``: the same as the ``flatgrad`` command."""

from .cli import main

raise SystemExit(main())
