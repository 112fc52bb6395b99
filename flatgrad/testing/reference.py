"""A reference for whole DeepSpeed engines: the exact mean gradient of a global batch, computed without ZeRO.

The reference runs in one process and needs every rank's micro-batches. Each step it starts from the
engine's own weights (what that step's forward used), so that the error it measures is that step's
arithmetic alone and not the divergence of two trajectories:

* the gradient of every micro-batch of every rank, computed on a plain copy of the model in the
  engine's compute dtype (the loss divided by ``gradient_accumulation_steps``, as ``engine.backward``
  divides it), then combined in fp64 as DeepSpeed defines the step's gradient:
  ``sum over micro-steps of (mean over ranks)``;
* the same optimizer stepped in fp64 from the engine's fp32 master weights with that gradient.

The bounds are rounding-error bounds of recursive summation (``|fl(sum) - sum| <= (n - 1) u sum|x_i|``),
evaluated on the data: see ``gradient_bound``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = [
    "UNIT_ROUNDOFF",
    "ReferenceOptimizer",
    "errors",
    "gradient_bound",
    "reference_gradients",
]

# Unit roundoff u = 2^-p of round-to-nearest with p significant bits (implicit bit included).
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}

Batch = tuple[torch.Tensor, torch.Tensor]


def reference_gradients(
    model: torch.nn.Module,
    weights: Sequence[torch.Tensor],
    batches: Sequence[Sequence[Batch]],
    loss_divisor: int,
    dtype: torch.dtype,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """The step's exact gradient and the sum of the absolute values it is made of, per parameter, in fp64.

    ``model`` is a plain copy of the engine's model (its parameters in ``model.parameters()`` order match
    ``weights``, the forward weights of this step); ``batches[r]`` are rank r's micro-batches of the step.
    Returns ``(mean, magnitude)``: ``mean = sum_k sum_r g_rk / W`` and ``magnitude = sum_k sum_r |g_rk| / W``
    where ``g_rk`` is the gradient of ``loss / loss_divisor`` (``engine.backward`` divides by
    ``gradient_accumulation_steps``) on rank r's k-th micro-batch; ``None`` for a parameter that no
    micro-batch reached (frozen, or unused).
    """
    params = list(model.parameters())
    assert len(params) == len(weights), (len(params), len(weights))
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)
    world_size = len(batches)
    mean: list[torch.Tensor | None] = [None] * len(params)
    magnitude: list[torch.Tensor | None] = [None] * len(params)
    for rank_batches in batches:
        for x, y in rank_batches:
            model.zero_grad(set_to_none=True)
            loss = model(x.to(dtype), y.to(dtype))
            (loss / loss_divisor).backward()
            for i, p in enumerate(params):
                if p.grad is None:
                    continue
                g = p.grad.double() / world_size
                mean[i] = g.clone() if mean[i] is None else mean[i] + g
                magnitude[i] = g.abs() if magnitude[i] is None else magnitude[i] + g.abs()
    model.zero_grad(set_to_none=True)
    return mean, magnitude


def gradient_bound(magnitude: torch.Tensor, world_size: int, micro_steps: int, dtype: torch.dtype) -> float:
    """An upper bound on ``||g - mean||`` for a gradient reduced and accumulated in ``dtype``.

    The engine's value of each element is a sum of the same ``W * micro_steps`` terms as the reference's
    (each rank's micro-batch gradients are the reference's bitwise: the same ops on the same weights),
    formed by ``W - 1`` additions in the reduction, ``micro_steps - 1`` additions across micro-steps, and
    at most one more rounding where a partial sum is stored in the gradients' dtype (a wider sum
    narrowed). The scales 1/W and 1/gradient_accumulation_steps are powers of two here, so exact.
    Recursive summation along paths of at most ``n`` roundings errs by at most ``gamma_n * sum|x_i|``,
    ``gamma_n = n u / (1 - n u)``, per element, hence in norm by ``gamma_n * ||magnitude||``.
    """
    u = UNIT_ROUNDOFF[dtype]
    n = (world_size - 1) + (micro_steps - 1) + 1
    gamma = n * u / (1 - n * u)
    return gamma * magnitude.double().norm().item()


def errors(value: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """Norm-wise ``||v - r|| / ||r||`` and elementwise ``max|v - r| / max|r|`` of two flat tensors, in fp64."""
    value, reference = value.double(), reference.double()
    scale = reference.norm().item()
    peak = reference.abs().max().item()
    diff = value - reference
    return diff.norm().item() / max(scale, 1e-300), diff.abs().max().item() / max(peak, 1e-300)


class ReferenceOptimizer:
    """A torch optimizer stepped in fp64 from given weights, keeping its own state across steps.

    ``step(weights, grads)`` sets the fp64 parameters to ``weights``, their gradients to ``grads``, steps,
    and returns the new weights. Two instances fed different gradients (the reference's, an engine's)
    measure how much the optimizer moves the weights for a given gradient difference.
    """

    def __init__(self, shapes: Sequence[torch.Size], factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
        self.params = [torch.zeros(shape, dtype=torch.float64, requires_grad=True) for shape in shapes]
        self.optimizer = factory(self.params)

    def step(self, weights: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        with torch.no_grad():
            for p, w, g in zip(self.params, weights, grads):
                p.copy_(w)
                p.grad = None if g is None else g.double().reshape(p.shape).clone()
        self.optimizer.step()
        return [p.detach().clone() for p in self.params]
