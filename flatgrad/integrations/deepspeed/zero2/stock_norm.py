"""ZeRO-1/2's clipping norm computed as stock DeepSpeed computes it, over flatgrad's sub-group partitions.

The clip factor divides every gradient by the norm, so a norm 1 ulp off moves them all: a norm
that clips is summed as stock sums it, per piece of stock's own partitions. See [Note: stock
clipping norm] in docs/design.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ....layout import Layout

__all__ = ["StockNorm"]


class StockNorm:
    """Where stock's per-rank partitions of every unsplit param group lie in this rank's sub-group partitions.

    Args:
        stock_groups: stock's flat order of every unsplit param group (its trainable params, as
            DeepSpeed flattens them).
        sub_groups: the params of every sub-group, in its flat order.
        layouts: every sub-group's ``Layout`` (flatgrad's partitions, DeepSpeed's flats).
        rank, world_size: this rank in the data-parallel group, and its size.
        align: DeepSpeed's ``nccl_start_alignment_factor`` (stock pads its flat to ``align * world_size``).
        host_root: root each group's sum as stock's offload path does (in fp64), not in fp32.
    """

    def __init__(
        self,
        stock_groups: Sequence[Sequence[torch.Tensor]],
        sub_groups: Sequence[Sequence[torch.Tensor]],
        layouts: Sequence[Layout],
        rank: int,
        world_size: int,
        align: int,
        host_root: bool = False,
    ):
        self.rank, self.world_size = rank, world_size
        self.host_root = host_root
        self.num_groups = len(stock_groups)
        stock_place: dict[int, tuple[int, int, int]] = {}  # param -> (group, offset in stock's flat, shard_numel)
        for g, params in enumerate(stock_groups):
            stock = Layout.flat([p.numel() for p in params], world_size, align)
            for p, offset in zip(params, stock.offsets):
                stock_place[id(p)] = (g, offset, stock.shard_numel)
        segments: list[tuple[int, int, int]] = []  # (sub-group, shard offset, length), in partition order
        index: list[int] = []  # group * world_size + stock rank, per segment
        for i, (params, layout) in enumerate(zip(sub_groups, layouts)):
            for pc in layout.pieces(rank):
                p = params[pc.tensor_index]
                if id(p) not in stock_place:
                    raise RuntimeError(f"flatgrad: a parameter of sub-group {i} is in no unsplit param group")
                g, base, shard = stock_place[id(p)]
                start, stop = base + pc.tensor_offset, base + pc.tensor_offset + pc.length  # in stock's flat
                while start < stop:
                    r = start // shard
                    end = min(stop, (r + 1) * shard)
                    segments.append((i, pc.shard_offset + start - base - pc.tensor_offset, end - start))
                    index.append(g * world_size + r)
                    start = end
        self.segments = segments
        self._rows = index
        self.index: torch.Tensor | None = None  # made on the partitions' device at the first call

    def partial_sums(self, partitions: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
        """This rank's share of stock's per-rank squared norms: fp64 ``[groups * world_size]``, on ``device``.

        ``partitions[i]`` is sub-group ``i``'s flat partition. One fp64 norm per
        segment, as stock takes one per piece (so no fp64 copy larger than stock's),
        on the partitions' device; the sums then move to ``device`` (where they are
        all_reduced; default: the partitions' device). See [Note: step placement].
        """
        where = partitions[0].device if len(partitions) else torch.device("cpu")
        if self.index is None or self.index.device != where:  # the partitions' device: [Note: step placement]
            self.index = torch.tensor(self._rows, dtype=torch.long, device=where)
        out = torch.zeros(self.num_groups * self.world_size, dtype=torch.float64, device=where)
        if self.segments:
            views = [partitions[i].narrow(0, offset, length) for i, offset, length in self.segments]
            norms = torch.stack(torch._foreach_norm(views, 2, dtype=torch.float64))
            out.index_add_(0, self.index, norms.pow(2.0))
        return out if device is None else out.to(device)

    def combine(self, sums: torch.Tensor, group: Any) -> torch.Tensor:
        """Stock's global norm from ``sums``, every rank's ``partial_sums`` added up (fp64, all ranks).

        Each stock rank's value is cast to fp32 as stock casts it, summed over the
        ranks in stock's order (above 2 ranks by stock's all_reduce, one per param
        group), rooted and masked per group, then combined by DeepSpeed's own rule.
        """
        import deepspeed.comm as dist
        from deepspeed.runtime.utils import combine_grad_norm_groups, mask_nan_or_inf_with_val_inplace

        per_rank = sums.view(self.num_groups, self.world_size).float()
        norms = []
        for g in range(self.num_groups):
            if self.world_size <= 2:
                total = per_rank[g].sum()  # one fp32 addition at most: as any all_reduce adds it
            else:
                total = per_rank[g, self.rank].clone()
                dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
            norm = total.double().sqrt().float() if self.host_root else total.pow(1.0 / 2.0)
            mask_nan_or_inf_with_val_inplace(norm, device=norm.device)
            norms.append(norm)
        return combine_grad_norm_groups(norms, norm_type=2)

    def metadata_bytes(self) -> int:
        """Bytes this plan keeps on the partitions' device: the segments' group-and-rank index."""
        return self.index.nbytes if self.index is not None else 0
