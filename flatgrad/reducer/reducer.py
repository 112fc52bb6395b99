"""BucketReducer: per bucket, one fused pack, one async reduce_scatter, one fused unpack into an fp32 shard.

Engine-agnostic: plain PyTorch uses it directly (``build_buckets`` + hooks), the
DeepSpeed integration drives it from its own hooks (``register_hooks=False``).

Per bucket and micro-step: the hooks count it down, it launches in bucket order once its gradients are
ready (``Bucket.reduce``: pack, collective), its unpack writes or adds its shard, and ``finish()`` waits for
all. See [Note: bucket lifecycle], [Note: shard lifetime], [Note: launch order] and [Note: streams] in
docs/design.md.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..kernels import DTYPES, resolve_backend
from ..layout import Layout, Piece, split_numels
from .agreement import LayoutMismatchError, agree, agreement_device
from .bucket import Bucket, describe_param
from .config import ReducerConfig
from .setup import plan_mode
from .topology import Topology
from .pool import CommPools
from .shards import TargetShards, arena_offsets, check_targets, make_store

__all__ = ["BucketReducer", "GradShard", "LayoutMismatchError", "ReducerConfig", "build_buckets"]


class GradShard(NamedTuple):
    """One bucket's gradient shard on this rank and what it holds.

    Attributes:
        bucket_id: index of the bucket.
        shard: tensor of ``layout.shard_numel`` elements (padding included), of the
            reducer's ``accum_dtype`` (fp32 by default).
        layout: the bucket's layout.
        params: the bucket's params, in layout order.
        pieces: ``layout.pieces(rank)``: which slice of which param lies where in ``shard``.
    """

    bucket_id: int
    shard: torch.Tensor
    layout: Layout
    params: list[nn.Parameter]
    pieces: list[Piece]


def build_buckets(params: Iterable[torch.Tensor] | nn.Module, bucket_numel: int) -> list[list[nn.Parameter]]:
    """Group the trainable params into buckets of about ``bucket_numel`` elements, in backward order.

    Backward order is taken as reverse registration order. The cuts are
    ``flatgrad.layout.split_numels``'s (a small param joins the next large one
    rather than making a collective of its own), and a bucket never mixes
    devices or dtypes. Given a module, modules that make sparse gradients
    (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) are refused.
    """
    if isinstance(bucket_numel, bool) or not isinstance(bucket_numel, int) or bucket_numel < 1:
        raise ValueError(f"bucket_numel must be an int >= 1, got {bucket_numel!r}")
    if isinstance(params, nn.Module):
        for name, module in params.named_modules():
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
                raise ValueError(f"module {name!r} makes sparse gradients (sparse=True); flatgrad reduces dense ones")
        params = params.parameters()
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of parameters or a module, not one tensor")
    seen: set[int] = set()
    ordered = []
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"params[{i}] is a {type(p).__name__}, not a tensor")
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            ordered.append(p)
    ordered.reverse()
    buckets: list[list[nn.Parameter]] = []
    start = 0
    for end in range(1, len(ordered) + 1):  # runs of one device and dtype, each cut by split_numels
        if end == len(ordered) or (ordered[end].device, ordered[end].dtype) != (ordered[start].device, ordered[start].dtype):
            run = ordered[start:end]
            buckets += [run[a:b] for a, b in split_numels([p.numel() for p in run], bucket_numel)]
            start = end
    return buckets


class BucketReducer:
    """Reduce-scatters gradients bucket by bucket into persistent fp32 shards. See [Note: bucket lifecycle].

    Args:
        buckets: lists of params, in the order their gradients become ready
            (``build_buckets`` makes them). Each list is one bucket; the params
            must require grad, be dense and share one device.
        config: how every bucket is reduced (``ReducerConfig``); its fields may
            also be given as keyword arguments (``comm_dtype=torch.bfloat16``),
            but not both.
        process_group: the data-parallel group (``None``: the default group).
        register_hooks: register a post-accumulate-grad hook on every param
            that calls ``mark_ready``; ``False`` when the caller has its own hooks.
        collectives: what issues the collectives (``None``: ``torch.distributed``); see
            [Note: collectives seam] in docs/design.md.
        shard_arena: ``None`` (each shard allocated on its own), or one arena position per
            bucket: the window's shards are then slices of one tensor, bucket ``b`` the
            ``shard_arena[b]``-th, so that an optimizer can update them as one tensor
            (see [Note: shard lifetime]).
        shard_targets: ``None``, or one persistent tensor per bucket (``layout.shard_numel``
            elements, any float dtype, any device: an optimizer's host partitions under
            offload) into which every window's shard ends; written in place where the
            target is on the bucket's device with ``accum_dtype``, else delivered by one
            copy per bucket (see [Note: shard targets] in docs/design.md).

    Attributes:
        config: the ``ReducerConfig``.
        mode: the ``ReductionMode`` every bucket runs (see [Note: reduction modes] in
            docs/design.md).
        buckets: the buckets, as lists of params in layout order.
        layouts: one ``Layout`` per bucket.
        rank: this rank in ``process_group``.
        world_size: size of ``process_group``.
        kernel_backends: the flatgrad kernel backend each bucket packs and unpacks with.
        comm_buffer_bytes: bytes of the comm buffer pools (comm buffers, and the all_to_all
            modes' receive or wire buffers), held from a micro-step's first launch to its
            ``finish()`` only.
        shard_bytes: bytes the reducer allocates for the shards of one accumulation window (held only
            during one; with ``shard_targets``, only for the targets not written in place).
        residual_bytes: bytes of the error-feedback residuals (held all the time; 0 without).
        topology: a two-stage reduction's placement of the group's ranks on nodes (``None`` for
            the flat modes); see [Note: two-stage reductions] in docs/design.md.
    """

    def __init__(
        self,
        buckets: Sequence[Sequence[nn.Parameter]],
        config: ReducerConfig | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        register_hooks: bool = True,
        collectives: comm.Collectives | None = None,
        shard_arena: Sequence[int] | None = None,
        shard_targets: Sequence[torch.Tensor] | None = None,
        **options: Any,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "BucketReducer needs an initialized process group: call torch.distributed.init_process_group first"
            )
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        if self.rank < 0:
            raise ValueError("this process is not a member of process_group")
        local_error: Exception | None = None
        description: list[tuple] = []
        self.topology: Topology | None = None
        try:
            config = _config(config, options)
            if collectives is not None and not isinstance(collectives, comm.Collectives):
                raise TypeError(f"collectives must be a flatgrad.comm.Collectives or None, got {type(collectives).__name__}")
            self.config = config
            self.mode, self.topology = plan_mode(config, process_group)
            specs = self._describe_buckets(buckets, register_hooks)
            offsets = arena_offsets(shard_arena, [s.layout for s in specs], [s.device for s in specs])
            check_targets(shard_targets, [s.layout for s in specs], shard_arena, config.accum_dtype)
            description = [s.description for s in specs]
        except Exception as exc:  # exchanged below so that every rank raises, then re-raised
            local_error = exc
        if self.world_size > 1:
            agree(process_group, self.rank, self.world_size, description, local_error, agreement_device(process_group))
        if local_error is not None:
            raise local_error
        self.mode.connect()  # every rank agreed on the mode (and its node size): the groups it needs
        self.accum_dtype = config.accum_dtype
        self.collect_stats = bool(config.collect_stats)
        self._collectives = collectives
        self._buckets = [self._bucket(i, spec) for i, spec in enumerate(specs)]
        self._comm = CommPools(self._buckets, config.comm_buffers)
        self.buckets: list[list[nn.Parameter]] = [list(b.params) for b in self._buckets]
        self.layouts: list[Layout] = [b.layout for b in self._buckets]
        self.kernel_backends: list[str] = [spec.backend for spec in specs]
        self.comm_buffer_bytes: int = self._comm.nbytes
        self._shards = make_store(self.accum_dtype, self._buckets, offsets, shard_targets)
        self.shard_bytes: int = self._shards.allocated_bytes(self._buckets, self.accum_dtype.itemsize)
        self.residual_bytes: int = sum(b.residual.nbytes for b in self._buckets if b.residual is not None)
        self._where = {p: (b, i) for b in self._buckets for i, p in enumerate(b.params)}
        self._next = 0  # the first bucket not launched yet this micro-step; see [Note: launch order]
        self._in_step = False  # some bucket was marked or launched since the last finish()
        self._inflight: deque[Bucket] = deque()  # CPU: launched buckets not unpacked yet
        self._lock = threading.Lock()  # hooks of several devices run on their own autograd threads
        self._hooks: list[Any] = []
        if register_hooks:
            for b in self._buckets:
                for p in b.params:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self.mark_ready))
                    _HOOKED[id(p)] = (weakref.ref(p), weakref.ref(self))

    # ------------------------------------------------------------------ setup

    def _describe_buckets(self, buckets: Sequence[Sequence[nn.Parameter]], register_hooks: bool) -> list["_BucketSpec"]:
        """Validate the buckets and describe every one; allocates nothing."""
        config = self.config
        if isinstance(buckets, torch.Tensor) or not isinstance(buckets, Sequence) or not buckets:
            raise TypeError("buckets must be a non-empty list of lists of parameters")
        seen: dict[int, tuple[int, int]] = {}
        specs = []
        for b, params in enumerate(buckets):
            if isinstance(params, torch.Tensor) or not isinstance(params, Sequence) or not params:
                raise TypeError(f"buckets[{b}] must be a non-empty list of parameters")
            for i, p in enumerate(params):
                where = f"buckets[{b}][{i}] ({describe_param(p) if isinstance(p, torch.Tensor) else type(p).__name__})"
                if not isinstance(p, torch.Tensor):
                    raise TypeError(f"{where} is not a tensor")
                if p.layout != torch.strided or (p.grad is not None and p.grad.layout != torch.strided):
                    raise ValueError(f"{where} is sparse; flatgrad reduces dense gradients only")
                if not p.requires_grad:
                    raise ValueError(f"{where} does not require grad; leave it out of the buckets")
                if p.dtype not in DTYPES:
                    raise ValueError(f"{where} has dtype {p.dtype}; supported: fp32, bf16, fp16")
                if p.device != params[0].device:
                    raise ValueError(
                        f"{where} is on {p.device} but buckets[{b}][0] is on {params[0].device}; one device per bucket"
                    )
                if register_hooks and _hook_owner(p) is not None:
                    raise ValueError(
                        f"{where} already has the gradient hook of another BucketReducer, whose pack frees "
                        "param.grad: call remove_hooks() on that reducer first"
                    )
                if id(p) in seen:
                    raise ValueError(f"{where} is the same param as buckets[{seen[id(p)][0]}][{seen[id(p)][1]}]")
                seen[id(p)] = (b, i)
            device = params[0].device
            dtypes = {p.dtype for p in params}
            if config.comm_dtype is None and len(dtypes) > 1:
                raise ValueError(f"buckets[{b}] mixes dtypes {sorted(map(str, dtypes))}; pass comm_dtype=")
            dtype = config.comm_dtype if config.comm_dtype is not None else params[0].dtype
            layout = Layout.make(config.layout, [p.numel() for p in params], self.world_size, config.align)
            avg = self.mode.averaging(config.average, self.world_size, dtype, self.process_group, device)
            method = comm.resolve_method(config.method, self.process_group, device)
            backend = getattr(resolve_backend(config.backend, device), "name", None)
            description = (
                config.layout, config.align, str(dtype), str(avg.op), method, self.mode.describe(),
                None if self.topology is None else self.topology.node_size,
                tuple((tuple(p.shape), str(p.dtype)) for p in params),
            )  # fmt: skip
            specs.append(_BucketSpec(tuple(params), layout, device, dtype, avg, method, backend, description))
        return specs

    def _bucket(self, bucket_id: int, spec: "_BucketSpec") -> Bucket:
        """A bucket's static plan and per-micro-step state (its buffers come from the pool)."""
        return Bucket(
            bucket_id, spec.params, spec.layout, self.rank, comm_dtype=spec.comm_dtype, averaging=spec.averaging,
            method=spec.method, backend=spec.backend, mode=self.mode, prescale=self.config.prescale,
            postscale=self.config.postscale, streams=_side_streams(spec.device) if spec.device.type == "cuda" else None,
        )  # fmt: skip

    @property
    def _pools(self) -> dict[tuple, list[torch.Tensor]] | None:
        """The pool buffers taken for this micro-step (``None`` between micro-steps)."""
        return self._comm.taken

    def _acquire_pools(self) -> None:
        """Take the pools for this micro-step, on the stream current there; see [Note: comm buffer pool]."""
        self._comm.acquire()

    # ------------------------------------------------------------------ hot path

    def mark_ready(self, param: nn.Parameter) -> None:
        """Record that ``param.grad`` is final for this micro-step; launch every bucket that can go.

        Called by the post-accumulate-grad hook, or by an integration's own hook.
        """
        where = self._where.get(param)
        if where is None:
            raise KeyError(f"param ({describe_param(param)}) is not in any bucket of this reducer")
        bucket, i = where
        with self._lock:
            if bucket.ready[i] or bucket.launched:
                raise RuntimeError(
                    f"bucket {bucket.id} param {i} ({describe_param(param)}) became ready twice in one micro-step: "
                    "call finish() after every backward, and run one backward per micro-step"
                )
            grad = param.grad
            if grad is not None and grad.layout != torch.strided:
                raise ValueError(
                    f"bucket {bucket.id} param {i} ({describe_param(param)}) got a sparse gradient; "
                    "flatgrad reduces dense gradients only"
                )
            if bucket.pack_stream is not None:
                # The hook runs on the stream this param's gradient was made on, which need not be
                # the stream of the hook that later launches the bucket. See [Note: streams].
                bucket.pack_stream.wait_stream(torch.cuda.current_stream(bucket.device))
            bucket.ready[i] = True
            bucket.pending -= 1
            self._in_step = True
            buckets = self._buckets
            while self._next < len(buckets) and buckets[self._next].pending == 0:
                self._launch(buckets[self._next])
                self._next += 1

    def _launch(self, b: Bucket) -> None:
        """Pack, drop the grads, start the collective (and on CUDA queue the unpack)."""
        grads = b.grads()
        self._comm.acquire()
        if b.pack_stream is None:
            if b.previous is not None and b.previous.in_flight:
                self._drain(block=True, through=b.previous)  # its comm buffer is this bucket's
            b.flight = b.reduce(grads, self.process_group, self._collectives)
            b.in_flight = True
            self._inflight.append(b)
        else:
            # See [Note: streams]. The shard is allocated on the current stream: see [Note: shard lifetime].
            self._ensure_shard(b)
            current = torch.cuda.current_stream(b.device)
            b.pack_stream.wait_stream(current)
            if b.previous is not None:
                b.pack_stream.wait_event(b.previous.unpacked)  # see [Note: comm buffer pool]
            with torch.cuda.stream(b.pack_stream):
                b.flight = b.reduce(grads, self.process_group, self._collectives)
                for g in grads:
                    if g is not None:
                        g.record_stream(b.pack_stream)
            with torch.cuda.stream(b.unpack_stream):
                if b.flight.work is not None:
                    b.flight.wait()
                else:
                    b.unpack_stream.wait_stream(b.pack_stream)
                self._unpack(b)
                b.unpacked.record(b.unpack_stream)
        for p in b.params:
            p.grad = None
        b.launched = True
        if self._inflight:
            self._drain(block=False)

    def _ensure_shard(self, b: Bucket) -> None:
        """Give ``b`` its shard for this window if it has none; its first unpack then copies. See [Note: shard lifetime]."""
        self._shards.ensure(b, self._buckets)

    def _unpack(self, b: Bucket) -> None:
        self._ensure_shard(b)
        b.stats = b.flight.unpack(b.shard, b.accumulate, self.collect_stats)
        b.accumulate = True
        self._shards.unpacked(b)

    def _drain(self, block: bool, through: Bucket | None = None) -> None:
        """CPU: unpack launched buckets in launch order.

        Waits for their collectives if ``block``; with ``through``, waits up to
        and including that bucket only.
        """
        while self._inflight:
            b = self._inflight[0]
            if not block and not b.flight.is_completed():
                return
            b.flight.wait()
            self._unpack(b)
            b.in_flight = False
            self._inflight.popleft()
            if b is through:
                return

    # ------------------------------------------------------------------ epilogue

    def finish(self) -> None:
        """Launch the buckets still waiting (missing grads count as zero), wait for all; shards are final."""
        with self._lock:
            for b in self._buckets[self._next :]:
                self._launch(b)
            self._next = len(self._buckets)
            self._drain(block=True)
            streams = {b.unpack_stream for b in self._buckets if b.unpack_stream is not None}
            for stream in streams:
                torch.cuda.current_stream(stream.device).wait_stream(stream)
            self._shards.finish()
            self._comm.release()
            for b in self._buckets:
                b.reset()
            self._next = 0
            self._in_step = False

    def zero_grad(self) -> None:
        """Start a new accumulation window and release the shards (see [Note: shard lifetime]).

        Call it once the optimizer has consumed the shards; the next micro-step
        allocates fresh ones and copies into them instead of adding.
        """
        if self._in_step:
            raise RuntimeError("zero_grad() in the middle of a micro-step: call finish() first")
        self._shards.release(self._buckets)

    def move_shards(self, device: torch.device | str | None = None, non_blocking: bool = False) -> None:
        """Put this window's shards on ``device`` (values kept, their old memory freed); ``None``: back on the
        buckets' own devices.

        For an owner that parks the reduced gradients between backward and step
        (DeepSpeed's ``offload_states``): the shards must be back home before the
        next micro-step or read. No shards: nothing moves.
        """
        if self._in_step:
            raise RuntimeError("move_shards() in the middle of a micro-step: call finish() first")
        devices = {b.device for b in self._buckets}
        if device is None and len(devices) > 1:
            raise RuntimeError(f"move_shards() home is one device, this reducer's buckets are on {sorted(map(str, devices))}")
        home = next(iter(devices)) if device is None and devices else device
        if home is not None:
            self._shards.move(self._buckets, torch.device(home), non_blocking)

    def grad_shards(self) -> list[GradShard]:
        """Every bucket's shard with its layout, params and pieces (valid after ``finish()``, until ``zero_grad()``)."""
        if self._in_step or any(b.shard is None for b in self._buckets):
            raise RuntimeError(
                "no gradient shards: none were reduced since the last zero_grad(), or a micro-step is still "
                "running (run a backward and finish() first)"
            )
        return [GradShard(b.id, b.shard, b.layout, list(b.params), list(b.pieces)) for b in self._buckets]

    @property
    def shard_arena(self) -> torch.Tensor | None:
        """With ``shard_arena``: the one tensor every bucket's shard is a slice of (``None`` outside a window)."""
        return self._shards.arena

    @property
    def final_micro_step(self) -> bool:
        """With ``shard_targets``: whether this micro-step ends the window, so each unpack delivers its shard.

        The owner sets it before the micro-step's backward (see [Note: shard targets]).
        """
        return isinstance(self._shards, TargetShards) and self._shards.final

    @final_micro_step.setter
    def final_micro_step(self, final: bool) -> None:
        if not isinstance(self._shards, TargetShards):
            raise RuntimeError("final_micro_step needs a reducer made with shard_targets")
        self._shards.final = bool(final)

    @property
    def target_copies(self) -> int:
        """With ``shard_targets``: how many shards were copied into their targets so far (0 when all are in place)."""
        return self._shards.copies if isinstance(self._shards, TargetShards) else 0

    def deliver(self) -> None:
        """With ``shard_targets``: move every shard not delivered yet this window into its target, and wait for it.

        Valid after ``finish()``; the shards are the targets afterwards (see [Note: shard targets]).
        """
        if not isinstance(self._shards, TargetShards):
            raise RuntimeError("deliver() needs a reducer made with shard_targets")
        if self._in_step:
            raise RuntimeError("deliver() in the middle of a micro-step: call finish() first")
        self._shards.deliver_all(self._buckets)

    def state_dict(self) -> dict[str, Any]:
        """What the reducer carries from step to step, for checkpoints: the error-feedback residuals.

        ``{"reduction": the mode's description, "residuals": per bucket the residual (a live reference, as
        ``nn.Module.state_dict`` gives) or None}``. Residuals are this rank's own; save one per rank.
        """
        return {"reduction": self.mode.describe(), "residuals": [b.residual for b in self._buckets]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``'s residuals (copied into the reducer's own); raises naming what does not fit."""
        if not isinstance(state, Mapping) or "residuals" not in state:
            raise ValueError("state must be a BucketReducer.state_dict() (a mapping with 'residuals')")
        if tuple(state.get("reduction", ())) != tuple(self.mode.describe()):
            raise ValueError(
                f"state['reduction'] is {state.get('reduction')!r}, this reducer runs {self.mode.describe()!r}"
            )
        residuals = list(state["residuals"])
        if len(residuals) != len(self._buckets):
            raise ValueError(f"state['residuals'] has {len(residuals)} entries, this reducer has {len(self._buckets)} buckets")
        for b, saved in zip(self._buckets, residuals):
            mine = b.residual
            if (saved is None) != (mine is None) or (
                saved is not None and (not isinstance(saved, torch.Tensor) or saved.shape != mine.shape or saved.dtype != mine.dtype)
            ):
                got = None if not isinstance(saved, torch.Tensor) else f"{tuple(saved.shape)} {saved.dtype}"
                want = None if mine is None else f"{tuple(mine.shape)} {mine.dtype}"
                raise ValueError(f"state['residuals'][{b.id}] is {got}, bucket {b.id} holds {want}")
        for b, saved in zip(self._buckets, residuals):
            if saved is not None:
                b.residual.copy_(saved)

    @property
    def stats_available(self) -> bool:
        """Whether every unpack computes the stats ``shard_stats()`` returns (every reduction mode's does)."""
        return self.collect_stats

    def shard_stats(self) -> list[torch.Tensor]:
        """Per bucket, fp32 ``[sum_sq, nonfinite_count]`` of its shard as the last unpack wrote it.

        Needs ``collect_stats``; valid after ``finish()``. Computed in the unpack's own
        pass, so reading them costs no pass over the shards.
        """
        if not self.stats_available:
            raise RuntimeError("shard_stats() needs a reducer made with collect_stats=True")
        if self._in_step or any(b.stats is None for b in self._buckets):
            raise RuntimeError("no shard stats: a bucket was not unpacked since the last zero_grad(), or finish() is due")
        return [b.stats for b in self._buckets]

    def plan_bytes(self) -> int:
        """Bytes of the buckets' pack and unpack plans' tensor tables (metadata, counted in memory figures)."""
        plans = [b.pack_plan for b in self._buckets] + [b.unpack_plan for b in self._buckets if b.unpack_plan]
        return sum(plan.table_bytes for plan in plans)

    def metadata_bytes(self) -> int:
        """Bytes kept besides gradients and comm buffers: plan tables; inside a window, the stats (8 B a bucket)."""
        return self.plan_bytes() + sum(b.stats.nbytes for b in self._buckets if b.stats is not None)

    def has_shards(self) -> bool:
        """Whether any bucket holds a shard (an accumulation window is open)."""
        return any(b.shard is not None for b in self._buckets)

    def remove_hooks(self) -> None:
        """Remove the post-accumulate-grad hooks this reducer registered."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for b in self._buckets:
            for p in b.params:
                if _hook_owner(p) is self:
                    del _HOOKED[id(p)]



class _BucketSpec(NamedTuple):
    """One bucket as validated and described before any rank allocates (see [Note: layout agreement])."""

    params: tuple[nn.Parameter, ...]
    layout: Layout
    device: torch.device
    comm_dtype: torch.dtype
    averaging: comm.Averaging
    method: str
    backend: str | None
    description: tuple


def _config(config: ReducerConfig | None, options: dict[str, Any]) -> ReducerConfig:
    """The reducer's config: ``config``, or one made of the keyword ``options``, never both."""
    unknown = sorted(set(options) - set(ReducerConfig.fields()))
    if unknown:
        raise TypeError(f"BucketReducer got unexpected keyword argument(s) {unknown}; see ReducerConfig for the settings")
    if config is None:
        return ReducerConfig(**options)
    if not isinstance(config, ReducerConfig):
        raise TypeError(f"config must be a flatgrad.reducer.ReducerConfig, got {type(config).__name__}")
    if options:
        raise TypeError(f"pass the settings in config or as keyword arguments, not both (got config and {sorted(options)})")
    return config


_STREAMS: dict[torch.device, tuple[Any, Any]] = {}

# Params whose post-accumulate-grad hook belongs to a live reducer: a second one would see the
# gradient the first one's pack already freed, and reduce zeros. Keyed by id (tensors compare
# elementwise), with weak references so that neither params nor reducers are kept alive.
_HOOKED: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _hook_owner(p: torch.Tensor) -> "BucketReducer | None":
    entry = _HOOKED.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


def _side_streams(device: torch.device) -> tuple[Any, Any]:
    """The (pack_stream, unpack_stream) pair of ``device``, shared by every bucket there. See [Note: streams]."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _STREAMS:
        _STREAMS[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _STREAMS[device]
