"""Models for ``flatgrad plan``: builders on the meta device, and what a schedule needs to know of them.

A schedule depends on a model only through its parameters: their numels, their
registration order (DeepSpeed flattens param groups in that order), which are
trainable, which are MoE experts (and of which expert-parallel size), and the
order in which their gradient hooks fire in backward (DeepSpeed fills its
buckets in that order). ``describe`` extracts exactly that into a
``ModelSpec``; the schedules never touch the module again.

Built-in models (``MODELS``):

* ``gpt2-xl``: GPT-2 XL, 1,557,611,200 parameters (48 layers, d=1600, 25 heads,
  vocabulary 50257, 1024 positions, ``lm_head`` tied to ``wte``), parameters
  registered in Hugging Face's ``GPT2LMHeadModel`` order.
* ``llama-7b``: LLaMA-7B, 6,738,415,616 parameters (32 layers, d=4096, MLP
  11008, vocabulary 32000, untied ``lm_head``), Hugging Face's
  ``LlamaForCausalLM`` order.
* ``seed-moe``: the model of the ZeRO-2 seed thread (docs/design.md "The seed
  model"): ``fc1``, ``fc2`` and ``moeBertLayer.output``, a
  ``deepspeed.moe.layer.MoE`` of 16 experts (each ``fc1``/``fc2`` of
  1000x1000), expert-parallel size 4, top-1 gating: 10,026,000 trainable
  parameters per rank.
* ``gpt``, ``mlp``: the same builders at any size (``--model-arg``), for tests
  and quick looks.

Hooks fire in autograd's order, which is not reverse registration in general,
so ``describe`` traces it with one meta-device backward (ZeRO-3's too, with its
``memory_efficient_linear`` in place). See [Note: backward hook order] in docs/design.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MODELS",
    "ModelSpec",
    "ParamInfo",
    "GPT",
    "Llama",
    "MLP",
    "SimpleMoeModel",
    "build",
    "describe",
    "load",
    "parse_model_args",
]


# --------------------------------------------------------------------------- what a schedule needs


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One parameter as DeepSpeed sees it.

    Attributes:
        index: position in ``module.parameters()`` (registration order, tied parameters once).
        name: its qualified name.
        shape: its shape.
        requires_grad: whether the optimizer owns it.
        expert_group: DeepSpeed's expert group name (``"ep_size_4"``) for MoE expert
            parameters, None for dense ones.
        ep_size: the expert-parallel size of that group (1 for dense parameters).
    """

    index: int
    name: str
    shape: tuple[int, ...]
    requires_grad: bool
    expert_group: str | None = None
    ep_size: int = 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model reduced to what collective schedules depend on. See [Note: backward hook order].

    Attributes:
        name: what the model was asked for by.
        params: every parameter, in registration order.
        backward_order: indices into ``params`` of the trainable parameters, in the
            order their gradient hooks fire; trainable parameters that get no
            gradient are left out (DeepSpeed never reduces them in ZeRO-2/3 backward).
        zero3_backward_order: the same under ZeRO-3, whose ``memory_efficient_linear``
            (on by default) replaces ``torch.nn.functional.linear`` with an autograd
            function that yields the weight's gradient before the bias's.
        order_source: ``"traced"`` (a meta-device backward) or ``"declared"``
            (reverse registration, from a module that cannot run on meta).
        parameters: the module's parameter objects (meta tensors), in
            registration order, for code that groups real parameters.
        dtype: the parameters' dtype.
    """

    name: str
    params: tuple[ParamInfo, ...]
    backward_order: tuple[int, ...]
    order_source: str
    zero3_backward_order: tuple[int, ...] = ()
    parameters: tuple[nn.Parameter, ...] = dataclasses.field(repr=False, compare=False, default=())
    dtype: torch.dtype = torch.float32

    @property
    def numel(self) -> int:
        """Trainable elements (each tied parameter once)."""
        return sum(p.numel for p in self.params if p.requires_grad)

    @property
    def ep_sizes(self) -> dict[str, int]:
        """Expert group name -> expert-parallel size, for every expert group of the model."""
        return {p.expert_group: p.ep_size for p in self.params if p.expert_group is not None}


# --------------------------------------------------------------------------- built-in modules


class _Attention(nn.Module):
    def __init__(self, d: int, n_head: int, fused_qkv: bool, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        if fused_qkv:
            self.c_attn = nn.Linear(d, 3 * d, bias=bias)
            self.c_proj = nn.Linear(d, d, bias=bias)
        else:
            self.q_proj = nn.Linear(d, d, bias=bias)
            self.k_proj = nn.Linear(d, d, bias=bias)
            self.v_proj = nn.Linear(d, d, bias=bias)
            self.o_proj = nn.Linear(d, d, bias=bias)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        return x.view(b, t, self.n_head, d // self.n_head).transpose(1, 2)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        b, t, d = x.shape
        if hasattr(self, "c_attn"):
            q, k, v = self.c_attn(x).split(d, dim=2)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        if rope is not None:
            q, k = _apply_rope(q, k, *rope)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        return self.c_proj(y) if hasattr(self, "c_proj") else self.o_proj(y)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class _GPTBlock(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = _Attention(d, n_head, fused_qkv=True, bias=True)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Module()
        self.mlp.c_fc = nn.Linear(d, 4 * d)
        self.mlp.c_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """A GPT-2 language model (pre-LayerNorm, learned positions, ``lm_head`` tied to ``wte``).

    Parameters are registered in Hugging Face's ``GPT2LMHeadModel`` order
    (``transformer.wte``, ``transformer.wpe``, per block ``ln_1``, ``attn.c_attn``,
    ``attn.c_proj``, ``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``, then ``ln_f``).
    ``forward(idx, targets)`` returns the mean cross-entropy loss.
    """

    def __init__(self, vocab: int = 50257, n_positions: int = 1024, d: int = 768, n_layer: int = 12, n_head: int = 12) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(vocab, d)
        self.transformer.wpe = nn.Embedding(n_positions, d)
        self.transformer.h = nn.ModuleList(_GPTBlock(d, n_head) for _ in range(n_layer))
        self.transformer.ln_f = nn.LayerNorm(d)
        self.vocab = vocab

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        tr = self.transformer
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = tr.wte(idx) + tr.wpe(pos)
        for block in tr.h:
            x = block(x)
        logits = tr.ln_f(x) @ tr.wte.weight.t()
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))

    def plan_inputs(self, batch: int = 1, seq: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        """A token batch on this model's device, for tracing the backward order."""
        device = self.transformer.wte.weight.device
        idx = torch.zeros(batch, seq, dtype=torch.long, device=device)
        return idx, idx


class _RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _LlamaLayer(nn.Module):
    def __init__(self, d: int, n_head: int, d_ff: int) -> None:
        super().__init__()
        self.self_attn = _Attention(d, n_head, fused_qkv=False, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(d, d_ff, bias=False)
        self.mlp.up_proj = nn.Linear(d, d_ff, bias=False)
        self.mlp.down_proj = nn.Linear(d_ff, d, bias=False)
        self.input_layernorm = _RMSNorm(d)
        self.post_attention_layernorm = _RMSNorm(d)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        h = self.post_attention_layernorm(x)
        return x + self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class Llama(nn.Module):
    """A LLaMA language model (RMSNorm, rotary positions, SwiGLU MLP, untied ``lm_head``).

    Parameters are registered in Hugging Face's ``LlamaForCausalLM`` order.
    ``forward(idx, targets)`` returns the mean cross-entropy loss.
    """

    def __init__(self, vocab: int = 32000, d: int = 4096, n_layer: int = 32, n_head: int = 32, d_ff: int = 11008) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, d)
        self.model.layers = nn.ModuleList(_LlamaLayer(d, n_head, d_ff) for _ in range(n_layer))
        self.model.norm = _RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.vocab, self.head_dim = vocab, d // n_head

    def _rope(self, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim))
        angles = torch.outer(torch.arange(seq, device=device).float(), inv)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rope = self._rope(idx.shape[1], idx.device)
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, rope)
        logits = self.lm_head(self.model.norm(x))
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))

    def plan_inputs(self, batch: int = 1, seq: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        """A token batch on this model's device, for tracing the backward order."""
        device = self.lm_head.weight.device
        idx = torch.zeros(batch, seq, dtype=torch.long, device=device)
        return idx, idx


class MLP(nn.Module):
    """A tanh MLP with odd widths (partitions straddle parameters); ``frozen`` freezes the first layer.

    ``forward(x, y)`` returns the mean squared error.
    """

    def __init__(self, d_in: int = 13, hidden: int = 37, d_out: int = 5, layers: int = 3, frozen: bool = False) -> None:
        super().__init__()
        dims = [d_in] + [hidden] * (layers - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.scale = nn.Parameter(torch.ones(d_out))
        if frozen:
            for p in self.layers[0].parameters():
                p.requires_grad_(False)
        self.d_in, self.d_out = d_in, d_out

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.tanh(x)
        return F.mse_loss(x * self.scale, y)

    def plan_inputs(self, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
        """An input batch on this model's device, for tracing the backward order."""
        device = self.scale.device
        return torch.zeros(batch, self.d_in, device=device), torch.zeros(batch, self.d_out, device=device)


class _SimpleExpert(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, hidden)
        self.fc2 = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class _MoEBertLayer(nn.Module):
    def __init__(self, hidden: int, num_experts: int, ep_size: int, k: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.output = MoE(hidden_size=hidden, expert=_SimpleExpert(hidden), num_experts=num_experts, ep_size=ep_size, k=k)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, aux, _ = self.output(x)
        return out, aux


class SimpleMoeModel(nn.Module):
    """The seed thread's model: ``fc1``, ``fc2``, ``moeBertLayer.output`` (DeepSpeed MoE, top-k gating).

    The MoE is DeepSpeed's own ``deepspeed.moe.layer.MoE``, whose construction
    needs no process group (DeepSpeed's engine creates the expert groups at
    ``initialize``), so the same class serves the plan (on meta) and real runs.
    The forward is not in the thread; this is docs/design.md's choice:
    ``relu(fc1(x)) -> fc2 -> MoE``, mean squared error plus 0.01 x the gate's
    auxiliary loss. Its backward order is declared, see [Note: backward hook order].
    """

    def __init__(self, hidden: int = 1000, num_experts: int = 16, ep_size: int = 4, k: int = 1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.moeBertLayer = _MoEBertLayer(hidden, num_experts, ep_size, k)
        self.hidden = hidden

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.fc2(F.relu(self.fc1(x)))
        out, aux = self.moeBertLayer(h)
        return F.mse_loss(out, y) + 0.01 * aux

    def plan_backward_order(self) -> list[str]:
        """Parameter names in hook order: reverse registration (see [Note: backward hook order])."""
        return [n for n, p in reversed(list(self.named_parameters())) if p.requires_grad]


# name -> (factory, default kwargs)
MODELS: dict[str, tuple[Callable[..., nn.Module], dict[str, Any]]] = {
    "gpt2-xl": (GPT, dict(vocab=50257, n_positions=1024, d=1600, n_layer=48, n_head=25)),
    "llama-7b": (Llama, dict(vocab=32000, d=4096, n_layer=32, n_head=32, d_ff=11008)),
    "seed-moe": (SimpleMoeModel, dict(hidden=1000, num_experts=16, ep_size=4, k=1)),
    "gpt": (GPT, dict(vocab=97, n_positions=16, d=24, n_layer=2, n_head=2)),
    "mlp": (MLP, dict()),
}


# --------------------------------------------------------------------------- building and loading


def _resolve(model: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    if model in MODELS:
        factory, defaults = MODELS[model]
        return factory, dict(defaults)
    if ":" not in model:
        raise ValueError(f"unknown model {model!r}: use one of {sorted(MODELS)} or 'module:factory'")
    module_name, _, attr = model.partition(":")
    if not module_name or not attr:
        raise ValueError(f"model {model!r}: 'module:factory' needs both a module and a factory name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"model {model!r}: cannot import module {module_name!r}: {exc}") from exc
    factory: Any = module
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise ValueError(f"model {model!r}: module {module_name!r} has no attribute {attr!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ValueError(f"model {model!r}: {attr!r} is not callable")
    return factory, {}


def build(model: str, device: str | torch.device = "meta", **kwargs: Any) -> nn.Module:
    """Build ``model`` (a name in ``MODELS`` or ``module:factory``) on ``device``; ``kwargs`` override defaults."""
    factory, args = _resolve(model)
    args.update(kwargs)
    with torch.device(device):
        module = factory(**args)
    if not isinstance(module, nn.Module):
        raise TypeError(f"model {model!r}: the factory returned {type(module).__name__}, not a torch.nn.Module")
    return module


def parse_model_args(items: Sequence[str]) -> dict[str, Any]:
    """``["n_layer=2", "frozen=true"]`` -> ``{"n_layer": 2, "frozen": True}`` (ints, floats, booleans, strings)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--model-arg {item!r}: expected KEY=VALUE with KEY a Python identifier")
        value: Any = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for kind in (int, float):
                try:
                    value = kind(raw)
                    break
                except ValueError:
                    pass
        out[key] = value
    return out


def _expert_groups(module: nn.Module) -> dict[int, tuple[str, int]]:
    """id(param) -> (expert group name, ep_size) for DeepSpeed MoE expert parameters."""
    sizes: dict[str, int] = {}
    for m in module.modules():
        name, ep = getattr(m, "expert_group_name", None), getattr(m, "ep_size", None)
        if isinstance(name, str) and isinstance(ep, int):
            sizes[name] = ep
    out = {}
    for p in module.parameters():
        # deepspeed.moe.utils.is_moe_param: an ``allreduce`` attribute that is False.
        if hasattr(p, "allreduce") and not p.allreduce:
            group = getattr(p, "group_name", None)
            if group is None:
                raise ValueError("an expert parameter (allreduce=False) has no group_name; DeepSpeed cannot group it")
            if group not in sizes:
                match = re.fullmatch(r"ep_size_(\d+)", group)
                if match is None:
                    raise ValueError(f"cannot tell the expert-parallel size of expert group {group!r}")
                sizes[group] = int(match.group(1))
            out[id(p)] = (group, sizes[group])
    return out


def _trace_order(module: nn.Module, names: Mapping[int, int], zero3: bool = False) -> list[int]:
    """Registration indices of trainable parameters in the order their grad hooks fire (one meta backward).

    ``zero3``: with ``torch.nn.functional.linear`` replaced, for the duration, by
    DeepSpeed's ``zero3_linear_wrap``, as ZeRO-3's ``memory_efficient_linear`` does.
    """
    order: list[int] = []
    handles = []
    linear = F.linear
    if zero3:
        from deepspeed.runtime.zero.linear import zero3_linear_wrap

        F.linear = zero3_linear_wrap
    for p in module.parameters():
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(lambda q: order.append(names[id(q)])))
    try:
        out = module(*module.plan_inputs())
        loss = out if out.dim() == 0 else out.sum()
        loss.backward()
    finally:
        F.linear = linear
        for h in handles:
            h.remove()
        for p in module.parameters():
            p.grad = None
    return order


def describe(module: nn.Module, name: str = "model", order: str = "auto", zero3: bool = True) -> ModelSpec:
    """Reduce ``module`` to a ``ModelSpec``. See [Note: backward hook order].

    Args:
        module: the model (on the meta device for large models).
        name: a label for reports.
        order: ``"auto"`` (trace if the module has ``plan_inputs()``, else its
            ``plan_backward_order()``, else reverse registration), ``"trace"``,
            or ``"reverse"`` (reverse registration order).
        zero3: also trace the order under ZeRO-3's linear (imports DeepSpeed); else
            ``zero3_backward_order`` repeats ``backward_order``.
    """
    if order not in ("auto", "trace", "reverse"):
        raise ValueError(f"order must be 'auto', 'trace' or 'reverse', got {order!r}")
    parameters = list(module.named_parameters())
    if not parameters:
        raise ValueError(f"model {name!r} has no parameters")
    experts = _expert_groups(module)
    index = {id(p): i for i, (_, p) in enumerate(parameters)}
    infos = tuple(
        ParamInfo(i, n, tuple(p.shape), bool(p.requires_grad), *experts.get(id(p), (None, 1)))
        for i, (n, p) in enumerate(parameters)
    )
    trainable = [i for i, info in enumerate(infos) if info.requires_grad]
    if order == "trace" or (order == "auto" and hasattr(module, "plan_inputs")):
        if not hasattr(module, "plan_inputs"):
            raise ValueError(f"model {name!r} has no plan_inputs(); cannot trace its backward order")
        backward, source = _trace_order(module, index), "traced"
        backward3 = _trace_order(module, index, zero3=True) if zero3 else backward
    elif order == "auto" and hasattr(module, "plan_backward_order"):
        by_name = {n: i for i, (n, _) in enumerate(parameters)}
        backward, source = [by_name[n] for n in module.plan_backward_order()], "declared"
    else:
        backward, source = list(reversed(trainable)), "reverse registration"
    if source != "traced":
        backward3 = backward
    for seq in (backward, backward3):
        if len(set(seq)) != len(seq) or not set(seq) <= set(trainable):
            raise ValueError(f"model {name!r}: the backward order repeats a parameter or names a frozen one")
    dtypes = {p.dtype for _, p in parameters}
    return ModelSpec(
        name=name,
        params=infos,
        backward_order=tuple(backward),
        order_source=source,
        zero3_backward_order=tuple(backward3),
        parameters=tuple(p for _, p in parameters),
        dtype=parameters[0][1].dtype if len(dtypes) == 1 else torch.float32,
    )


def load(model: str, order: str = "auto", zero3: bool = True, **kwargs: Any) -> ModelSpec:
    """Build ``model`` on the meta device and describe it (see ``build`` and ``describe``)."""
    return describe(build(model, "meta", **kwargs), name=model, order=order, zero3=zero3)
