"""DeepSpeed ZeRO-1/2 on flatgrad: bucket-aligned sub-groups, one reduce_scatter per sub-group.

One concern per module: ``groups`` (the sub-group split, before DeepSpeed flattens), ``partitions`` (DeepSpeed's
partitions checked against flatgrad's layouts), ``reduction`` (``Zero2Reduction``, which builds the parts below and
takes the backward's seams, and ``install``), ``context`` (the fixed facts the parts read), ``window`` (the
accumulation window and its hand-over), ``step`` (the merged step), ``stats`` (norm and overflow from the unpack),
``stock_norm`` (the clipping norm as stock computes it), ``checkpoint`` (the saver and loaders) and ``seams`` (what is
replaced on DeepSpeed's optimizer, and stock's methods kept).
"""

from .groups import prepare, split_param_groups
from .reduction import Zero2Reduction, install

__all__ = ["Zero2Reduction", "install", "prepare", "split_param_groups"]
