"""Memory of the gradient path per rank, for every schedule ``flatgrad plan`` models.

What differs between stock DeepSpeed and flatgrad is the gradient path: the
buffers the reduction uses and the gradient partitions it fills. Model states
(parameters, fp32 master weights, optimizer moments) and activations are the
same for both and are left out. ``P`` is the trainable parameter count, ``W``
the world size, ``B`` the bucket (``reduce_bucket_size``) in elements, ``g``
the gradient dtype's bytes and ``c`` the comm dtype's.

* stock ZeRO-1/2: nothing between steps. During backward the IPG bucket
  (``B g``, one buffer without ``overlap_comm``) and the gradient partition in
  the gradient dtype (``P g / W``); at the step, the fp32 copy of that
  partition (``4 P / W``).
* flatgrad ZeRO-1/2: nothing between steps either. During backward the pool
  of comm buffers (as many as stock's IPG buffers, of the largest sub-group,
  about ``B``: ``B c``), up to one sub-group of gradients waiting for its
  pack (``B g``), and the fp32 partitions (``4 P / W``, filled bucket by
  bucket), which step() reads with no copy.
* ZeRO-3, stock and flatgrad: the fp32 gradient partitions (``4 P / W``) and
  the IPG bucket (``B c``) persist; flatgrad packs straight from the
  gradients, which wait for their bucket's pack (up to ``B g`` more at the
  peak). flatgrad's ZeRO-3 peak equals stock's (``bench/memory.py``, in
  docs/results.md): the wait overlaps stock's own IPG copy.

``bench/memory.py`` measures all of this on real engines; these formulas
project it to sizes no test machine holds.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["GradientPathMemory", "gradient_path_memory"]


class GradientPathMemory(NamedTuple):
    """Bytes per rank of one schedule's gradient path.

    Attributes:
        between: held between optimizer steps.
        peak: held at the most, during backward or the step.
    """

    between: float
    peak: float


def gradient_path_memory(
    key: str, numel: int, world_size: int, bucket: int, grad_bytes: int, comm_bytes: int, comm_buffers: int = 1
) -> GradientPathMemory:
    """The gradient-path bytes per rank of the schedule ``key`` (``stock_zero2``, ``flatgrad_zero3``, ...)."""
    p, w, b = float(numel), float(world_size), float(min(bucket, numel))
    if key.startswith("stock_zero2"):
        return GradientPathMemory(0.0, b * grad_bytes + p * grad_bytes / w + 4 * p / w)
    if key == "flatgrad_zero2":
        pool = comm_buffers * b * comm_bytes
        return GradientPathMemory(0.0, pool + 4 * p / w + b * grad_bytes)
    if key in ("stock_zero3", "flatgrad_zero3"):
        held = 4 * p / w + b * comm_bytes
        return GradientPathMemory(held, held)
    raise ValueError(f"no memory model for schedule {key!r}")
