"""flatgrad for DeepSpeed ZeRO-1/2/3: ``initialize`` (drop-in for ``deepspeed.initialize``) and ``patch()``.

    engine, optimizer, _, scheduler = flatgrad.deepspeed.initialize(model=model, config=ds_config, ...)

or, leaving the training script as it is, ``flatgrad.deepspeed.patch()`` (or
``FLATGRAD_DEEPSPEED=1`` with ``import flatgrad``). Options live in the
config's ``"flatgrad"`` section (see ``FlatgradConfig``).
"""

from .integrations.deepspeed.config import FlatgradConfig, UnsupportedConfigError
from .integrations.deepspeed.initialize import initialize
from .integrations.deepspeed.patch import is_patched, patch, unpatch

__all__ = ["FlatgradConfig", "UnsupportedConfigError", "initialize", "is_patched", "patch", "unpatch"]
