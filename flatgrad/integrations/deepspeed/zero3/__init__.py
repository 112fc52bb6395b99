"""DeepSpeed ZeRO-3 on flatgrad: DeepSpeed's buckets, partitions and step; flatgrad's per-bucket pack -> reduce_scatter
-> unpack.

One concern per module: ``reduction`` (``Zero3Reduction``: the two IPG seams, the bucket compositions and the
reduce), ``offload`` (``Zero3Offload``: the host side of optimizer offload, its staging and the boundary's fp32
copies), ``stats`` (``Zero3Stats``: the step's norm and overflow from the unpacks), and ``seams`` (the checks and
refusals, the reduction mode, what is replaced on DeepSpeed's optimizer, and ``install``). See the ZeRO-3 notes in
docs/design.md.
"""

from .reduction import Zero3Reduction
from .seams import ZERO3_REDUCTIONS, check_offload, install

__all__ = ["ZERO3_REDUCTIONS", "Zero3Reduction", "check_offload", "install"]
