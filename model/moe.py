"""A mixture-of-experts MLP, readable top to bottom.

    x (T, C) -> router logits (T, E) -> scores -> top-k experts and weights per token
             -> permute: token copies sorted by expert, overflow beyond capacity dropped
             -> experts: one grouped GEMM per projection over the stacked weights (E, ...)
             -> unpermute: each copy back to its (token, slot), summed with the routing weights
             (+ shared experts on every token)

The four stages are separate functions (``route``, ``permute``, ``expert_mlp``, ``unpermute``)
so expert parallelism can put a dispatch ``all_to_all`` after ``permute`` and a combine after
``expert_mlp`` without changing them; the expert weights are plain parameters stacked on a
leading expert dimension, so sharding experts is slicing that dimension.

Routing follows the published recipes:
- scoring: softmax over experts (Switch, Mixtral, Qwen-MoE) or per-expert sigmoid (DeepSeek-V3);
  the chosen experts' scores are the weights, optionally renormalised to sum to 1 over the top-k,
  then multiplied by ``model.moe.routed_scale``.
- load balancing: the Switch/GShard auxiliary loss ``E * sum_i f_i * P_i`` (f_i: fraction of the
  T*k assignments given to expert i, P_i: expert i's mean normalised score; 1.0 at perfect
  balance), the ST-MoE router z-loss ``mean(logsumexp(logits)^2)``, and DeepSeek-V3's
  auxiliary-loss-free bias: a per-expert bias added to the scores only to *choose* experts,
  moved after each optimizer step by ``rate * sign(mean load - load)`` (``update_expert_bias``).
- capacity: with factor c > 0 each expert takes at most ceil(c * T * k / E) token copies, the
  earliest tokens first; the rest are dropped (that slot contributes nothing, the residual
  stream carries the token on). c = 0 is dropless. T is one forward's micro-batch: under context
  parallelism its whole sequences (the cp ranks count together, so they keep what one process
  keeps); under expert or data parallelism each rank's own micro-batch (one process whose
  micro-batches are the ranks' batches); under tensor parallelism with sequence parallelism each
  rank's slice of it.

Expert GEMMs run through ``torch._grouped_mm`` where this torch, device, dtype and shape allow
(``select_expert_backend`` says why not), else one GEMM per expert over the sorted tokens.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.nn as nn

from common.errors import CapabilityError
from common.values import local_shard
from kernels.reference import clamped_swiglu
from kernels.registry import REFERENCE_OPS, KernelOps
from model.config import ModelConfig

EXPERT_BACKENDS = ("grouped_mm", "loop")
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what its CPU kernel accepts (torch 2.13)
GROUPED_MM_MIN_CAPABILITY = (9, 0)  # its CUDA kernel is Hopper's


# --------------------------------------------------------------------------- 1. routing


@dataclass
class Routing:
    experts: torch.Tensor  # (T, k) int64: the chosen experts of each token, best first
    weights: torch.Tensor  # (T, k) fp32: what each chosen expert's output is multiplied by
    probs: torch.Tensor  # (T, E) fp32: normalised scores (each row sums to 1), for the auxiliary loss
    logits: torch.Tensor  # (T, E) fp32: router logits, for the z-loss


def route(logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool, routed_scale: float,
          bias: torch.Tensor | None = None, groups: int = 1, groups_kept: int | None = None) -> Routing:
    """Choose ``top_k`` experts per token from router logits (T, E).

    ``bias`` (aux-loss-free balancing, DeepSeek-V3's score correction) shifts which experts are
    chosen, never the weights. With ``groups`` > 1 (DeepSeek-V3's group-limited routing) the E
    experts form equal groups, a group's score is the sum of its two best (biased) scores, and a
    token chooses only within its ``groups_kept`` best groups: under expert parallelism with a
    group per node, each token's copies reach at most that many nodes.
    """
    logits = logits.float()
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    choose_by = scores if bias is None else scores + bias.float()
    if groups > 1 and (groups_kept or groups) < groups:
        grouped = choose_by.view(-1, groups, choose_by.shape[-1] // groups)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # (T, groups)
        kept = torch.zeros_like(group_score, dtype=torch.bool).scatter_(
            1, group_score.topk(groups_kept, dim=-1).indices, True)
        choose_by = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view_as(choose_by)
    experts = choose_by.topk(top_k, dim=-1).indices
    weights = scores.gather(-1, experts)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * routed_scale
    probs = scores if scoring == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    return Routing(experts, weights, probs, logits)


TokenMean = Callable[[torch.Tensor], torch.Tensor]


def expert_counts(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(E,) int64: how many of the expert numbers ``experts`` (N,) name each expert. ``torch.bincount``'s
    length depends on the values it counts, so torch.compile breaks its graph there; this one's is E."""
    counts = torch.zeros(n_experts, dtype=torch.int64, device=experts.device)
    return counts.scatter_add_(0, experts, torch.ones_like(experts))


def load_balancing_loss(routing: Routing, n_experts: int, sum_counts: TokenMean | None = None,
                        token_mean: TokenMean | None = None) -> torch.Tensor:
    """Switch/GShard auxiliary loss E * sum_i f_i * P_i: 1.0 when load and scores are uniform.

    f_i (the fraction of assignments, a count) carries no gradient; P_i carries it to the router.
    ``sum_counts`` sums the counts over the ranks holding the other (equal) parts of these sequences
    whose losses are averaged later (context parallelism): f_i is then the whole sequences' and P_i
    this part's, so the mean of the parts' losses is the loss of the whole sequences. ``token_mean``
    turns this rank's means into those over every rank holding a slice of the same tokens and the
    same loss (``MoE.token_mean``, tensor parallelism's sequence slices).
    """
    counts = expert_counts(routing.experts.flatten(), n_experts)
    if sum_counts is not None:
        counts = sum_counts(counts)
    means = torch.stack([counts.float() / counts.sum().clamp(min=1), routing.probs.mean(dim=0)])  # (2, E): f, P
    if token_mean is not None:
        means = token_mean(means)
    return n_experts * (means[0] * means[1]).sum()


def router_z_loss(routing: Routing, token_mean: TokenMean | None = None) -> torch.Tensor:
    """ST-MoE's z-loss: keeps router logits small, so the softmax stays out of its flat regions."""
    z = torch.logsumexp(routing.logits, dim=-1).square().mean()
    return z if token_mean is None else token_mean(z)


def expert_capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int | None:
    """Token copies one expert may take (None: dropless)."""
    if capacity_factor == 0:
        return None
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


# --------------------------------------------------------------------------- 2. permute


@dataclass
class Dispatch:
    slots: torch.Tensor  # (A,) kept assignments as flat indices t*k + j, grouped by expert, token order within
    counts: torch.Tensor  # (E,) token copies each expert computes (after capacity)
    routed: torch.Tensor  # (E,) token copies routed to each expert (before capacity)


def permute(x: torch.Tensor, experts: torch.Tensor, n_experts: int, capacity: int | None,
            ops: KernelOps = REFERENCE_OPS, earlier: torch.Tensor | None = None) -> tuple[torch.Tensor, Dispatch]:
    """x (T, C) -> one row per kept (token, expert) assignment, sorted by expert: (A, C).
    The gather itself is ``ops.moe_permute`` (a Triton kernel or its PyTorch twin).

    ``earlier`` (T, k): per assignment, the assignments to the same expert that other ranks hold
    and that come before it in the whole batch's token order (context parallelism: ``MoE.earlier_elsewhere``);
    capacity then keeps the copies one process would keep."""
    k = experts.shape[1]
    flat = experts.flatten()  # (T*k,)
    slots = torch.argsort(flat, stable=True)  # stable: earlier tokens come first within an expert
    routed = expert_counts(flat, n_experts)
    counts = routed
    if capacity is not None:
        starts = torch.cumsum(routed, 0) - routed
        position = torch.arange(slots.numel(), device=x.device) - starts[flat[slots]]
        if earlier is not None:
            position = position + earlier.flatten()[slots]
        slots = slots[position < capacity]
        counts = routed.clamp(max=capacity) if earlier is None else expert_counts(flat[slots], n_experts)
    return ops.moe_permute(x, slots, k), Dispatch(slots, counts, routed)


# --------------------------------------------------------------------------- 3. experts


def grouped_mm_unusable(device: torch.device, dtype: torch.dtype, widths: Iterable[int],
                        compiled: bool = False) -> str | None:
    """Why ``torch._grouped_mm`` cannot run these expert GEMMs here (None: it can).

    Its kernels want fp32/bf16/fp16 (bf16 on CUDA), rows whose byte strides are multiples of 16
    (CPU and CUDA alike), and on CUDA a Hopper GPU. Under torch.compile (``compiled``) its shape
    function, which the compiler traces with, takes bf16 only, whatever the CPU kernel takes.
    """
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if compiled and dtype != torch.bfloat16:
        return f"compute dtype is {dtype}; torch.compile traces torch._grouped_mm in bf16 only"
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < GROUPED_MM_MIN_CAPABILITY:
            return "its CUDA kernel needs compute capability 9.0 (Hopper)"
        if dtype != torch.bfloat16:
            return f"compute dtype is {dtype}; its CUDA kernel takes bf16"
    elif device.type != "cpu":
        return f"device is {device.type}"
    if dtype not in GROUPED_MM_DTYPES:
        return f"compute dtype is {dtype}; it takes fp32, bf16 or fp16"
    itemsize = torch.empty((), dtype=dtype).element_size()
    odd = [w for w in widths if (w * itemsize) % 16]
    if odd:
        return f"widths {odd} x {itemsize} bytes are not multiples of 16 bytes"
    return None


def select_expert_backend(requested: str, device: torch.device, dtype: torch.dtype, cfg: ModelConfig,
                          compiled: bool = False) -> tuple[str, str]:
    """Resolve model.moe.backend to ``grouped_mm`` or ``loop``, with a log line saying why."""
    why = grouped_mm_unusable(device, dtype, (cfg.d_model, cfg.expert_d_ff), compiled)
    if requested == "auto":
        if why is None:
            return "grouped_mm", "experts: grouped_mm (auto: torch._grouped_mm runs this device, dtype and shape)"
        return "loop", f"experts: loop, one GEMM per expert (auto: grouped_mm not used because {why})"
    if requested == "grouped_mm" and why is not None:
        raise CapabilityError(f"model.moe.backend=grouped_mm cannot run: {why}; use model.moe.backend=loop or auto"
                              + (", or train.compile=false" if compiled else ""))
    return requested, f"experts: {requested} (requested)"


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, backend: str) -> torch.Tensor:
    """Rows of x (A, K), grouped by expert in ``counts``, times their expert's w[e] (E, K, N) -> (A, N)."""
    if torch.is_autocast_enabled(x.device.type):  # _grouped_mm has no autocast rule: cast as a GEMM would be
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w = x.to(dtype), w.to(dtype)
    if backend == "grouped_mm":
        return torch._grouped_mm(x, w, offs=torch.cumsum(counts, 0).to(torch.int32))
    rows = x.split(counts.tolist())  # one host sync per call: the reference path
    return torch.cat([r @ w_e for r, w_e in zip(rows, w)])


ExpertBiases = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]  # (gate, up, down), each (E, width)


def expert_mlp(x: torch.Tensor, counts: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
               w_gate: torch.Tensor | None, ops: KernelOps, gelu_approximate: str, backend: str,
               biases: ExpertBiases | None = None, clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """The experts' MLPs on token rows sorted by expert (A, C) -> (A, C): SwiGLU with a gate, else GELU.

    ``biases``: each expert's (gate, up, down) biases, added to its rows (gpt-oss); ``clamp``:
    (alpha, limit) of gpt-oss's clamped SwiGLU (kernels/reference.py ``clamped_swiglu``).

    The loop backend runs eagerly inside a torch.compile'd block: its GEMMs take each expert's row
    count from the host, and a graph traced through them would be specialised on those counts (the
    compiler recompiled it at nearly every step). One graph break per layer instead."""
    if backend == "loop":
        return _eager_expert_mlp(x, counts, w_up, w_down, w_gate, ops, gelu_approximate, backend, biases, clamp)
    return _expert_mlp(x, counts, w_up, w_down, w_gate, ops, gelu_approximate, backend, biases, clamp)


def _expert_mlp(x: torch.Tensor, counts: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                w_gate: torch.Tensor | None, ops: KernelOps, gelu_approximate: str, backend: str,
                biases: ExpertBiases | None = None, clamp: tuple[float, float] | None = None) -> torch.Tensor:
    b_gate, b_up, b_down = biases or (None, None, None)

    def plus(y: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:  # row r gets its expert's bias
        return y if b is None else y + torch.repeat_interleave(b.to(y.dtype), counts, dim=0, output_size=y.shape[0])

    up = plus(grouped_matmul(x, w_up, counts, backend), b_up)
    if w_gate is not None:
        gate = plus(grouped_matmul(x, w_gate, counts, backend), b_gate)
        h = ops.swiglu(gate, up) if clamp is None else clamped_swiglu(gate, up, *clamp)
    else:
        h = ops.bias_gelu(up, None, gelu_approximate)
    return plus(grouped_matmul(h, w_down, counts, backend), b_down)


_eager_expert_mlp = torch.compiler.disable(_expert_mlp)


# --------------------------------------------------------------------------- 4. unpermute


def unpermute(y: torch.Tensor, dispatch: Dispatch, weights: torch.Tensor, ops: KernelOps = REFERENCE_OPS
              ) -> torch.Tensor:
    """Expert outputs (A, C) back to their tokens: (T, C) = sum over slots of weight * output, summed in
    a fixed order (no scatter-add), dropped slots zero (``ops.moe_unpermute``: kernels/reference.py)."""
    return ops.moe_unpermute(y, dispatch.slots, weights)


# --------------------------------------------------------------------------- the layer


class RouterStats:
    """What one MoE layer's router did in training forwards since last read, kept on the device.

    Two readers: the log window (load, dropped copies, auxiliary loss) and the aux-loss-free bias
    update (load since the last optimizer step). Activation recompute runs a forward twice; both
    readers use ratios (max/mean, dropped/routed, mean aux, sign of load - mean), which a uniform
    doubling leaves unchanged.
    """

    def __init__(self) -> None:
        self.window: dict[str, torch.Tensor] = {}
        self.since_update: torch.Tensor | None = None
        self.paused = False  # forwards that route no micro-batch (``router_stats_paused``)

    # Eager in a torch.compile'd block: the compiler guards on this Python state (which keys the
    # window holds, whether two entries are one tensor), which changes between the first forwards
    # of a window and the rest, and recompiled the layer's tail twice.
    @torch.compiler.disable
    def add(self, dispatch: Dispatch, aux: torch.Tensor | None) -> None:
        if self.paused:
            return
        routed = dispatch.routed.detach()
        add = {"routed": routed, "dropped": (routed - dispatch.counts).sum(),
               "aux": aux.detach().float() if aux is not None else routed.new_zeros((), dtype=torch.float32),
               "forwards": routed.new_ones(())}
        for key, value in add.items():
            self.window[key] = self.window[key] + value if key in self.window else value
        self.since_update = routed if self.since_update is None else self.since_update + routed

    def take_window(self) -> dict[str, torch.Tensor]:
        window, self.window = self.window, {}
        return window

    def take_load(self) -> torch.Tensor | None:
        load, self.since_update = self.since_update, None
        return load


class MoE(nn.Module):
    """Routed experts (stacked weights) and optional shared experts, in place of a block's MLP."""

    def __init__(self, cfg: ModelConfig, ops: KernelOps, backend: str = "loop", shared: nn.Module | None = None,
                 layer_idx: int = 0):
        """``shared``: the always-on experts, one dense MLP of width moe.shared_experts * expert_d_ff."""
        super().__init__()
        if backend not in EXPERT_BACKENDS:
            raise ValueError(f"unknown expert backend {backend!r}; choose one of {EXPERT_BACKENDS}")
        e, d, f = cfg.moe.experts, cfg.d_model, cfg.expert_d_ff
        self.n_experts, self.top_k, self.ops, self.backend = e, cfg.moe.top_k, ops, backend
        self.scoring, self.renormalize, self.routed_scale = cfg.moe.router, cfg.moe.renormalize, cfg.moe.routed_scale
        self.aux_coef, self.z_coef, self.capacity_factor = cfg.moe.aux_loss, cfg.moe.z_loss, cfg.moe.capacity
        self.groups, self.groups_kept = cfg.moe.groups, cfg.moe.groups_kept
        self.gelu_approximate = "tanh" if cfg.gelu == "tanh" else "none"
        self.clamp = None if cfg.swiglu_limit is None else (cfg.swiglu_alpha, cfg.swiglu_limit)
        self.router = nn.Linear(d, e, bias=cfg.moe.bias)
        # Stacked (E, in, out): x @ w[e] per expert, the layout torch._grouped_mm takes as it is.
        self.w_gate = nn.Parameter(torch.empty(e, d, f)) if cfg.mlp == "swiglu" else None
        self.w_up = nn.Parameter(torch.empty(e, d, f))
        self.w_down = nn.Parameter(torch.empty(e, f, d))
        # Per-expert biases (gpt-oss), stacked on the same expert dimension as the weights.
        with_bias = cfg.moe.bias
        self.b_gate = nn.Parameter(torch.zeros(e, f)) if with_bias and self.w_gate is not None else None
        self.b_up = nn.Parameter(torch.zeros(e, f)) if with_bias else None
        self.b_down = nn.Parameter(torch.zeros(e, d)) if with_bias else None
        if cfg.moe.bias_update_rate > 0 or cfg.moe.score_bias:  # state of the run, so saved with the weights
            self.register_buffer("expert_bias", torch.zeros(e))
        else:
            self.expert_bias = None
        self.shared = shared
        self.layer_idx = layer_idx
        self.drop = nn.Dropout(cfg.dropout)
        self.stats = RouterStats()
        self.aux_loss: torch.Tensor | None = None  # set by a training forward, taken by GPT.forward
        # Sums a tensor over the ranks holding the other chunks of this rank's sequences (set by
        # context parallelism, parallel/cp.py): the load-balancing loss counts whole sequences.
        self.sum_over_sequence: TokenMean | None = None
        # Where other ranks route the rest of these sequences' tokens (tensor parallelism's sequence
        # slices), the mean over all of them of a per-token mean: the balancing losses are the
        # whole batch's, as in one process. None: this rank holds every token.
        self.token_mean: TokenMean | None = None
        # Where other ranks hold chunks of these sequences (context parallelism, parallel/cp.py):
        # (this rank's experts (B, s, k)) -> (``permute``'s ``earlier``, the tokens of the whole
        # sequences), so capacity is counted over whole sequences, as in one process.
        self.earlier_elsewhere: Callable[[torch.Tensor], tuple[torch.Tensor, int]] | None = None

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float, draw: Callable[[torch.Tensor, float], object] | None = None,
                     up_std: float | None = None) -> None:
        """Expert weights drawn by ``draw(w, std)`` (default: normal): the gate with ``std``, the up
        projection with ``up_std`` (default ``std``), the down projection, a residual projection like
        MLP.out, with ``out_std``; biases zero."""
        draw = draw or (lambda w, s: nn.init.normal_(w, 0.0, s))
        for w, w_std in ((self.w_gate, std), (self.w_up, std if up_std is None else up_std)):
            if w is not None:
                draw(w, w_std)
        draw(self.w_down, out_std)
        for b in (self.b_gate, self.b_up, self.b_down):
            if b is not None:
                b.zero_()
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (T, C), T = B * seq
        routing = route(self.router(x), self.top_k, self.scoring, self.renormalize, self.routed_scale,
                        self.expert_bias, self.groups, self.groups_kept)
        earlier, n_tokens = None, x.shape[0]
        if self.capacity_factor and self.earlier_elsewhere is not None:
            earlier, n_tokens = self.earlier_elsewhere(routing.experts.view(*shape[:-1], self.top_k))
        capacity = expert_capacity(n_tokens, self.top_k, self.n_experts, self.capacity_factor)
        rows, dispatch = permute(x, routing.experts, self.n_experts, capacity, self.ops, earlier)
        rows = self.run_experts(rows, dispatch.counts)
        y = self.drop(unpermute(rows, dispatch, routing.weights, self.ops))
        if self.shared is not None:
            y = y + self.shared(x)
        if self.training and torch.is_grad_enabled():
            self.aux_loss = self._aux_loss(routing)
            self.stats.add(dispatch, self.aux_loss)
        return y.view(shape)

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Token rows sorted by expert (A, C), ``counts`` (E,) per expert -> their outputs (A, C).
        The seam expert parallelism replaces (parallel/ep.py: dispatch, local experts, combine)."""
        return expert_mlp(rows, counts, self.w_up, self.w_down, self.w_gate, self.ops, self.gelu_approximate,
                          self.backend, (self.b_gate, self.b_up, self.b_down), self.clamp)

    def _aux_loss(self, routing: Routing) -> torch.Tensor | None:
        aux = None
        if self.aux_coef:
            aux = self.aux_coef * load_balancing_loss(routing, self.n_experts, self.sum_over_sequence, self.token_mean)
        if self.z_coef:
            z = self.z_coef * router_z_loss(routing, self.token_mean)
            aux = z if aux is None else aux + z
        return aux


# --------------------------------------------------------------------------- training-side helpers


def moe_layers(modules: Iterable[nn.Module]) -> list[MoE]:
    """Every MoE layer under ``modules`` (wrappers included), each once, in order."""
    seen, found = set(), []
    for root in modules:
        for m in root.modules():
            if isinstance(m, MoE) and id(m) not in seen:
                seen.add(id(m))
                found.append(m)
    return found


@contextlib.contextmanager
def router_stats_paused(module: nn.Module) -> Iterator[None]:
    """Forwards inside leave the router statistics of ``module``'s MoE layers alone: passes that
    route no micro-batch (a pipeline stage's shape inference on placeholder tensors, parallel/pp.py)."""
    layers = moe_layers([module])
    for m in layers:
        m.stats.paused = True
    try:
        yield
    finally:
        for m in layers:
            m.stats.paused = False


def take_aux_loss(modules: Iterable[nn.Module]) -> torch.Tensor | None:
    """The sum of the auxiliary losses the layers set in this forward (and forget them)."""
    total = None
    for m in modules:
        if isinstance(m, MoE) and m.aux_loss is not None:
            total = m.aux_loss if total is None else total + m.aux_loss
            m.aux_loss = None
    return total


class _AuxGradient(torch.autograd.Function):
    """Identity on ``x``, whose backward also sends gradient 1 into ``aux``: a pipeline stage's
    output carries its layers' auxiliary losses back (the schedule scales every gradient by
    1/micro-batches afterwards, as it does the loss's). The output is a copy, not a view of ``x``:
    the zero-bubble schedule's input-gradient pass frees the stage output with an in-place
    ``detach_()``, which autograd refuses on a view (an input returned as is counts as one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


def with_aux_gradient(x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    return _AuxGradient.apply(x, aux)


class _JoinAux(torch.autograd.Function):
    """``loss`` itself, whose gradient also goes into ``aux``: the gradient of loss + aux, with the
    language-model loss as the value. A loss computed on vocab-sharded logits (loss parallelism) is
    a replicated DTensor and so is its gradient; ``aux`` is a plain tensor and takes that gradient's
    local value (adding the two directly would hand DTensor gradients to plain autograd nodes)."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype = aux.dtype
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, local_shard(grad).to(ctx.aux_dtype)


def join_aux_gradient(loss: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    return _JoinAux.apply(loss, aux)


@torch.no_grad()
def update_expert_bias(layers: list[MoE], rate: float,
                       all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """DeepSeek-V3's auxiliary-loss-free step: bias_i += rate * sign(mean load - load_i).

    Called once per optimizer step, outside autograd; ``all_reduce_sum`` sums the loads over the
    data-parallel ranks first, so every rank moves its copy of the bias identically.
    """
    biased = [m for m in layers if m.expert_bias is not None]
    loads = [m.stats.take_load() for m in biased]
    if not biased or any(load is None for load in loads):
        return
    load = torch.stack(loads).float()  # (layers, E): one collective for all layers
    if all_reduce_sum is not None:
        load = all_reduce_sum(load)
    step = rate * torch.sign(load.mean(dim=1, keepdim=True) - load)
    for m, s in zip(biased, step):
        m.expert_bias.add_(s.to(m.expert_bias.dtype))


def take_router_table(layers: list[MoE], n_layers: int, n_experts: int, device: torch.device | str = "cpu"
                      ) -> torch.Tensor:
    """The log windows of ``layers`` as one (n_layers, E + 3) float64 table, and fresh windows.

    Row i, for the layer with ``layer_idx`` i: the token copies routed to each expert, the copies
    dropped by capacity, the summed auxiliary loss and the forwards counted; zeros for a layer this
    rank does not hold or did not run. The tables of ranks that route other tokens add up to the
    table of one process routing them all (``router_metrics`` reads only ratios, which ranks routing
    the same tokens leave unchanged); float64 keeps the counts exact.
    """
    table = torch.zeros(n_layers, n_experts + 3, dtype=torch.float64, device=device)
    for m in layers:
        w = m.stats.take_window()
        if w:
            table[m.layer_idx] = torch.cat([w["routed"].double(), w["dropped"].double().view(1),
                                            w["aux"].double().view(1), w["forwards"].double().view(1)])
    return table


def router_metrics(table: torch.Tensor) -> dict[str, float]:
    """The log's router metrics from a ``take_router_table`` table (one host sync).

    ``moe_aux_loss``: the weighted auxiliary loss per forward, summed over layers;
    ``moe_load_max_mean/<layer>``: max over experts of tokens routed / the mean, per layer (1.0 =
    balanced, E / k = all tokens on k experts); ``moe_dropped_frac``: copies dropped by capacity.
    """
    rows = [(i, r) for i, r in enumerate(table.tolist()) if r[-1] > 0]  # layers that ran
    if not rows:
        return {}
    routed = [r[:-3] for _, r in rows]
    metrics = {"moe_aux_loss": sum(r[-2] / r[-1] for _, r in rows),
               "moe_dropped_frac": sum(r[-3] for _, r in rows) / max(sum(sum(c) for c in routed), 1.0)}
    for (i, _), counts in zip(rows, routed):
        mean = sum(counts) / len(counts)
        metrics[f"moe_load_max_mean/{i}"] = max(counts) / mean if mean else float("nan")
    return metrics


def take_moe_metrics(layers: list[MoE]) -> dict[str, float]:
    """``router_metrics`` of the windows of these layers alone (one process), and fresh windows."""
    if not layers:
        return {}
    n_layers = max(m.layer_idx for m in layers) + 1
    return router_metrics(take_router_table(layers, n_layers, layers[0].n_experts, layers[0].router.weight.device))
