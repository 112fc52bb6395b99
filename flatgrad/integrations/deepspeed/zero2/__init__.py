"""DeepSpeed ZeRO-1/2 on flatgrad: bucket-aligned sub-groups, one reduce_scatter per sub-group.

One concern per module: ``groups`` (the sub-group split, before DeepSpeed flattens), ``partitions`` (DeepSpeed's
partitions checked against flatgrad's layouts), ``reduction`` (``Zero2Reduction``: the reducers, windows and
hand-over), ``step`` (the merged step), ``stats`` (norm and overflow from the unpack), ``stock_norm`` (the clipping norm as stock computes
it), ``checkpoint`` (the loaders),
and ``seams`` (what is replaced on DeepSpeed's optimizer, and ``install``).
"""

from .groups import prepare, split_param_groups
from .reduction import Zero2Reduction
from .seams import install

__all__ = ["Zero2Reduction", "install", "prepare", "split_param_groups"]
