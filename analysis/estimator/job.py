"""The job the estimator describes (``JobSpec``: a model and batch on a ``Layout``), the parameters of its
model (``Assumptions``), the choices it accepts, bytes per element of each precision, and its error type."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import ConfigError, LayoutError
from common.fields import choices
from common.hardware import DEVICES, DeviceSpec
from model.config import RECOMPUTE_POLICIES, ModelConfig
from parallel.config import ParallelConfig
from parallel.layout import Layout, check_model
from parallel.precision import PrecisionConfig

GIB = 2**30

# The choices the trainer's config sections accept, read from them (never a second copy).
STRATEGIES = choices(ParallelConfig, "strategy")
PRECISION_MODES = choices(PrecisionConfig, "mode")
PP_SCHEDULES = choices(ParallelConfig, "pp_schedule")
ATTENTION_KINDS = ("materialized", "flash")
# How a framework's ZeRO-1/2 reduces gradients: DeepSpeed's (the trainer's) all-reduces its gradient buckets,
# ZeRO-2 every micro-batch; Megatron's distributed optimizer (and the ZeRO paper's count) reduce-scatters
# the accumulated gradients once per step.
ZERO_REDUCTIONS = ("deepspeed", "reduce_scatter")
# How a framework's ZeRO-3/FSDP runs its collectives: over flat buffers, prefetched behind compute (FSDP,
# the trainer's), or one parameter tensor at a time, each waited for before compute goes on (DeepSpeed's
# ZeRO-3 as released in 2021: communication.py ``zero3_collective_count``).
ZERO3_COLLECTIVES = ("bucketed", "per_parameter_sync")
# What recompute=op_selective keeps of a layer's matmul outputs: all of them (the trainer's policy,
# model/recompute.py), or torchtitan's per-op policy, which keeps the 1st, 3rd, ... matmul of each block
# in forward order and recomputes the others (activations.py).
OP_SELECTIVE_SAVES = ("every_matmul", "alternate_matmuls")
# How an FP8 GEMM's operands get their scale (time.py ``fp8_cast_bytes``): Transformer Engine's delayed
# scaling takes it from the amax history (model/te.py), torchao's dynamic scaling computes it from the
# tensor first (precision.fp8_backend=torchao, tensorwise or rowwise).
FP8_SCALINGS = ("delayed", "dynamic")
# How often an FP8 GEMM's weight is cast (time.py ``fp8_cast_bytes``): at every micro-batch's forward (the
# trainer's Transformer Engine and torchao layers, and torchao under FSDP2, whose gathers run per micro-batch),
# or once per step: Megatron-Core's Transformer Engine layers pass is_first_microbatch, so the FP8 weight and
# its transpose are cast on a step's first micro-batch and reused by the others (published rows that ran it).
FP8_WEIGHT_CASTS = ("per_microbatch", "per_step")
# Which kernels cast an FP8 GEMM's operands (time.py ``fp8_cast_bytes``): a cast of its own for every operand
# over the GEMM's rows (the estimator's count for the trainer; torchao casts so), or Transformer Engine's
# layers as Megatron-Core builds them (published rows that ran it): the norm feeding QKV and a dense MLP's
# first matmul (TELayerNormColumnParallelLinear) writes FP8 itself under delayed scaling, or reduces the amax
# as it writes under current scaling (TE >= 2.7), and under sequence parallelism an all-gathered operand is
# cast on the GPU's own rows, gathered in FP8 and transposed after the gather.
FP8_CAST_KERNELS = ("separate", "megatron_te")
# The optimizers the trainer offers (optim.name): AdamW everywhere, or Muon on the hidden matrices.
OPTIMIZERS = ("adamw", "muon")
# Muon as the trainer runs it on a GPU: optim.muon.ns_steps' default, and the Newton-Schulz dtype of
# optim.muon.ns_dtype=auto (bf16 on CUDA), in which sharded matrices travel to their owners and back.
MUON_NS_STEPS = 5
MUON_PIECE_BYTES = 2
# How a core with attention sinks runs (JobSpec.sink_attention): the trainer's materialized reference core,
# which model.attention=auto picks for sinks (model/attention.py: sdpa and flash-attn have no sink term),
# or a fused kernel with the sink in its softmax, which stores no scores: Megatron-Core's softmax_type=learnable
# on Transformer Engine >= 2.8, run by cuDNN's fused attention from 9.13.1 (published rows that ran it).
SINK_ATTENTION = ("materialized", "fused")
# Which kernel runs a fused attention core (JobSpec.attention_kernel): FlashAttention-2's, what flash-attn 2 and
# PyTorch's SDPA flash backend run (the trainer, torchtitan), or the one Transformer Engine's DotProductAttention
# picks: cuDNN's fused attention on Hopper (TE prefers it over flash-attn there "for performance reasons",
# transformer_engine/pytorch/attention.py from v1.7), flash-attn 2 elsewhere (published rows that ran it).
ATTENTION_KERNELS = ("flash_attn2", "te")
# cuDNN's fused attention against FlashAttention-2 on an H100 SXM5 at head dim 128, sequences of 2k to 16k:
# 1.59-1.62x forward with a causal mask, 1.60-1.63x backward (Shah et al., FlashAttention-3, 2024, Figures 5
# and 6, cuDNN's kernel beside FlashAttention-2's). Stated, never fitted.
CUDNN_HOPPER_ATTENTION_SPEEDUP = 1.6
# Attention backends (model.attention) by what they store: only the reference keeps the scores.
ATTENTION_BACKEND_KIND = {"reference": "materialized", "sdpa": "flash", "flash_attn": "flash", "auto": "flash"}


class EstimatorError(ValueError):
    """Bad input to the estimator; the message names the argument and the valid choices."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of weights, gradients and optimizer state (AdamW)."""

    param: int
    grad: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optimizer


STATE_BYTES: dict[str, StateBytes] = {
    # fp32 weights and grads, fp32 exp_avg and exp_avg_sq.
    "fp32": StateBytes(4, 4, 8),
    # torch.autocast keeps fp32 parameters and gradients; only activations are 16-bit. This is why
    # "AMP halves memory" is wrong for model states.
    "bf16": StateBytes(4, 4, 8),
    "fp16": StateBytes(4, 4, 8),
    # 16-bit weights and grads, fp32 master + exp_avg + exp_avg_sq: the ZeRO paper's 2 + 2 + 12.
    "bf16_master": StateBytes(2, 2, 12),
    # Transformer Engine FP8 keeps bf16 weights and fp32 master state; its FP8 weight copies are
    # per-layer caches and not counted.
    "fp8": StateBytes(2, 2, 12),
}

ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "bf16_master": 2, "fp8": 2}


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise EstimatorError(f"{name}={value!r} is not valid; choose one of: {', '.join(choices)}")


@dataclass(frozen=True)
class Assumptions:
    """The parameters of the time and memory model (docs/estimator.md says where each comes from).

    The first six were fitted on the calibration half of the published measurements
    (analysis/published.py; ``python -m tools.published --fit`` reproduces them); the rest are stated
    in advance and were never fitted.
    """

    # fitted (docs/estimator.md, "Calibration")
    gemm_fraction_ampere: float = 0.92  # A100: a GEMM's share of the dense peak as its output dims grow without bound
    gemm_fraction_hopper: float = 0.62  # H100/H200: the same
    gemm_knee: float = 345.0  # an output dimension x runs at x / (x + knee) of that rate
    attention_fraction: float = 0.31  # a fused (flash) attention kernel's rate, relative to a large GEMM's
    elementwise_scale: float = 1.98  # multiplier on the counted element-wise memory traffic
    fp8_gemm_fraction: float = 0.71  # FP8 GEMMs: share of the dense FP8 peak as the output dims grow
    # stated
    overlap_efficiency: float = 0.5  # share of an overlappable collective that compute really hides
    link_fraction: float = 0.8  # of NVLink / NIC / PCIe one-way peak that a large collective reaches
    hbm_fraction: float = 0.8  # of HBM bandwidth that memory-bound kernels reach
    cuda_context_gib: float = 0.5  # CUDA context and kernel images, outside PyTorch's allocator
    comm_buffers_gib: float = 0.5  # NCCL channel buffers, outside PyTorch's allocator
    fragmentation: float = 0.1  # the caching allocator's reserve above the bytes allocated at the peak
    unsharded_layers: int = 2  # ZeRO-3/FSDP: the layer in use and the prefetched one

    def gemm_fraction(self, device: DeviceSpec) -> float:
        return self.gemm_fraction_ampere if device.family == "ampere" else self.gemm_fraction_hopper


# The parameters the calibration fits, in the order it searches them.
FITTED_PARAMETERS = ("gemm_fraction_ampere", "gemm_fraction_hopper", "gemm_knee", "attention_fraction",
                     "elementwise_scale", "fp8_gemm_fraction")


@dataclass(frozen=True)
class JobSpec:
    """One training job: model, batch, layout, recompute policy, precision and GPU.

    ``layout`` is the trainer's own value (parallel/layout.py), in the config's words: its world
    size is the GPU count, its dp_shard counts every data-parallel GPU the dense weights shard over,
    and it is checked by the same rules (those of this trainer's implementation aside: the estimator
    also models other frameworks' runs, e.g. Megatron-LM's DDP under tensor parallelism).
    ``grad_accum`` is the number of micro-batches per step (the pipeline's micro-batches under pp).
    ``tp_overlap``, ``dp_overlap`` and ``pp_overlap`` say whether the framework overlaps those
    collectives (the pipeline's sends) with compute: the trainer does not overlap tensor-parallel
    collectives or the pipeline's sends and overlaps data-parallel ones (other frameworks' published
    runs set them as they ran).
    """

    model: ModelConfig
    seq_len: int
    micro_batch: int
    layout: Layout = field(default_factory=Layout)
    recompute: str = "none"
    precision: str = "bf16_master"
    device: DeviceSpec = field(default_factory=lambda: DEVICES["H100"])
    grad_accum: int = 1
    assumptions: Assumptions = field(default_factory=Assumptions)
    tp_overlap: bool = False
    dp_overlap: bool = True
    pp_overlap: bool = False  # Megatron-Core's overlap_p2p_comm: an interleaved stage's sends beside its compute
    fsdp_reshard_after_forward: bool = True  # parallel.fsdp_reshard_after_forward
    zero_reduction: str = "deepspeed"  # ZERO_REDUCTIONS: how ZeRO-1/2 reduce gradients (communication.py)
    zero3_collectives: str = "bucketed"  # ZERO3_COLLECTIVES: how ZeRO-3/FSDP gathers and reduces (communication.py)
    ddp_no_sync: bool = True  # DDP reduces once per step (the trainer's no_sync); False: every micro-batch
    optimizer: str = "adamw"  # optim.name: muon keeps one state buffer per hidden matrix instead of two
    op_selective_saves: str = "every_matmul"  # OP_SELECTIVE_SAVES: which matmul outputs op_selective keeps
    loss_chunk_tokens: int = 0  # kernels.loss_chunk_tokens: the LM head and loss this many tokens at a time (0: whole)
    fp8_scaling: str = "delayed"  # FP8_SCALINGS: precision.fp8_backend te (delayed) or torchao (dynamic)
    fp8_weight_casts: str = "per_microbatch"  # FP8_WEIGHT_CASTS: a weight cast every micro-batch or once per step
    fp8_cast_kernels: str = "separate"  # FP8_CAST_KERNELS: every operand cast on its own, or as Megatron-Core's TE layers
    sink_attention: str = "materialized"  # SINK_ATTENTION: the core's kernel with model.attention_sinks
    attention_kernel: str = "flash_attn2"  # ATTENTION_KERNELS: which kernel runs a fused core

    def __post_init__(self) -> None:
        check_choice("strategy", self.layout.strategy, STRATEGIES)
        check_choice("recompute", self.recompute, RECOMPUTE_POLICIES)
        check_choice("precision", self.precision, PRECISION_MODES)
        check_choice("pp_schedule", self.layout.pp_schedule, PP_SCHEDULES)
        check_choice("zero_reduction", self.zero_reduction, ZERO_REDUCTIONS)
        check_choice("zero3_collectives", self.zero3_collectives, ZERO3_COLLECTIVES)
        if self.zero3_collectives == "per_parameter_sync" and (
                self.layout.pp > 1 or self.model.is_mla or self.model.moe.experts is not None or self.model.mtp_depth):
            raise EstimatorError("zero3_collectives=per_parameter_sync counts the parameter tensors of dense blocks "
                                 "without a pipeline (DeepSpeed's 2021 ZeRO-3); use bucketed for pp, MoE, MLA or MTP")
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("op_selective_saves", self.op_selective_saves, OP_SELECTIVE_SAVES)
        check_choice("fp8_scaling", self.fp8_scaling, FP8_SCALINGS)
        check_choice("fp8_weight_casts", self.fp8_weight_casts, FP8_WEIGHT_CASTS)
        check_choice("fp8_cast_kernels", self.fp8_cast_kernels, FP8_CAST_KERNELS)
        check_choice("sink_attention", self.sink_attention, SINK_ATTENTION)
        check_choice("attention_kernel", self.attention_kernel, ATTENTION_KERNELS)
        if self.pp_overlap and (self.layout.pp == 1 or self.layout.pp_schedule != "interleaved_1f1b"):
            raise EstimatorError("pp_overlap=True is Megatron-Core's overlap_p2p_comm, which runs only with an "
                                 "interleaved schedule; set pp_schedule=interleaved_1f1b with pp > 1, or pp_overlap=False")
        if self.op_selective_saves == "alternate_matmuls" and (self.model.is_mla or self.model.moe.experts is not None):
            raise EstimatorError("op_selective_saves=alternate_matmuls counts a dense grouped-query layer's matmuls "
                                 "(q, k, v, output, then the MLP's); use every_matmul for latent attention or MoE")
        for key in ("seq_len", "micro_batch", "grad_accum"):
            if getattr(self, key) < 1:
                raise EstimatorError(f"{key} must be >= 1 (got {getattr(self, key)})")
        if self.loss_chunk_tokens < 0:
            raise EstimatorError(f"loss_chunk_tokens must be >= 0 (got {self.loss_chunk_tokens}; 0 computes the whole logits)")
        try:
            check_model(self.layout, self.model, seq_len=self.seq_len, micro_batches=self.grad_accum, seq_key="seq_len")
        except ConfigError as exc:
            raise EstimatorError(str(exc)) from None
        if self.precision == "fp8" and self.device.fp8_tflops is None:
            raise EstimatorError(f"precision=fp8 needs FP8 tensor cores; {self.device.name} has none (use bf16_master)")
        if self.model.attention_sinks and self.model.attention in ("sdpa", "flash_attn"):
            raise EstimatorError(f"model.attention={self.model.attention} cannot run model.attention_sinks (no sink "
                                 "term in its softmax); use model.attention=reference or auto")

    @property
    def local_seq_len(self) -> int:
        """Tokens of each sequence on one GPU (seq_len / cp): what activations scale with."""
        return self.seq_len // self.layout.cp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all GPUs."""
        return self.micro_batch * self.grad_accum * self.layout.dp

    @property
    def attention(self) -> str:
        # sdpa and flash_attn never store the scores on a GPU; only the reference backend does, and
        # it is the one the trainer runs attention sinks on (model/attention.py: the others have no sink
        # term); a framework with a fused sink kernel says so (sink_attention=fused).
        if self.model.attention_sinks:
            return "flash" if self.sink_attention == "fused" else "materialized"
        return ATTENTION_BACKEND_KIND[self.model.attention]

    @property
    def activation_dtype_bytes(self) -> int:
        return ACTIVATION_BYTES[self.precision]


def layout_of(world_size: int = 1, **keys) -> Layout:
    """A ``Layout`` of ``world_size`` GPUs (``keys``: its parallel keys), its errors as the estimator's."""
    try:
        return Layout(world_size, **keys)
    except (ConfigError, LayoutError) as exc:
        raise EstimatorError(str(exc)) from None
