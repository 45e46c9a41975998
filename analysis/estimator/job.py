"""The job the estimator describes (``JobSpec``), the parameters of its model (``Assumptions``), the
choices it accepts, bytes per element of each precision, and its error type."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.fields import choices
from common.hardware import DEVICES, DeviceSpec
from model.config import RECOMPUTE_POLICIES, ModelConfig
from parallel.config import ParallelConfig
from parallel.precision import PrecisionConfig

GIB = 2**30

# The choices the trainer's config sections accept, read from them (never a second copy).
STRATEGIES = choices(ParallelConfig, "strategy")
PRECISION_MODES = choices(PrecisionConfig, "mode")
PP_SCHEDULES = choices(ParallelConfig, "pp_schedule")
ATTENTION_KINDS = ("materialized", "flash")
# Attention backends (model.attention) by what they store: only the reference keeps the scores.
ATTENTION_BACKEND_KIND = {"reference": "materialized", "sdpa": "flash", "flash_attn": "flash", "auto": "flash"}
# Schedules that run several model chunks (virtual stages) per GPU.
MULTI_CHUNK_SCHEDULES = ("interleaved_1f1b", "zero_bubble")


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


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise EstimatorError(f"{name}={value!r} is not valid; choose one of: {', '.join(choices)}")


def torch_microbatch_rule(schedule: str, stages: int, microbatches: int) -> str | None:
    """Why torch's schedule refuses ``microbatches`` on ``stages`` stages, or None.

    Every schedule needs at least one micro-batch per stage (Schedule1F1B checks it; the layout
    requires it of all); the interleaved schedules run max(1, m // p) rounds and need m to be a
    multiple of them.
    """
    if stages == 1:
        return None
    if microbatches < stages:
        return f"grad_accum={microbatches} micro-batches must be >= pp={stages} stages"
    rounds = max(1, microbatches // stages)
    if schedule in MULTI_CHUNK_SCHEDULES and microbatches % rounds:
        return (f"pp_schedule={schedule} runs {rounds} rounds of micro-batches; grad_accum={microbatches} "
                f"must be a multiple of {rounds}")
    return None


@dataclass(frozen=True)
class Assumptions:
    """The parameters of the time and memory model (docs/estimator.md says where each comes from).

    The first six were fitted on the calibration half of the published measurements
    (analysis/published.py; ``python -m tools.published --fit`` reproduces them); the rest are stated
    in advance and were never fitted.
    """

    # fitted (docs/estimator.md, "Calibration")
    gemm_fraction_ampere: float = 0.92  # A100: a GEMM's share of the dense peak as its output dims grow without bound
    gemm_fraction_hopper: float = 0.61  # H100/H200: the same
    gemm_knee: float = 448.0  # an output dimension x runs at x / (x + knee) of that rate
    attention_fraction: float = 0.31  # a fused (flash) attention kernel's rate, relative to a large GEMM's
    elementwise_scale: float = 1.68  # multiplier on the counted element-wise memory traffic
    fp8_gemm_fraction: float = 0.99  # FP8 GEMMs: share of the dense FP8 peak as the output dims grow
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
    """One training job: model, batch, layout, strategy, recompute policy, precision and GPU.

    The layout fields are the config's ``parallel`` words; dp_shard is what remains of
    ``world_size`` after tp, pp and dp_replicate. ``grad_accum`` is the number of micro-batches
    per step (the pipeline's micro-batches under pp). ``tp_overlap`` and ``dp_overlap`` say whether
    the framework overlaps those collectives with compute: the trainer does not overlap tensor-parallel
    collectives and overlaps data-parallel ones (other frameworks' published runs set them as they ran).
    """

    model: ModelConfig
    seq_len: int
    micro_batch: int
    world_size: int = 1
    strategy: str = "fsdp"
    recompute: str = "none"
    precision: str = "bf16_master"
    device: DeviceSpec = field(default_factory=lambda: DEVICES["H100"])
    grad_accum: int = 1
    assumptions: Assumptions = field(default_factory=Assumptions)
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    sequence_parallel: bool | None = None  # None: on whenever tp > 1 (the config's default)
    cp: int = 1  # context parallelism: each sequence split over cp GPUs (parallel/cp.py)
    tp_overlap: bool = False
    dp_overlap: bool = True
    fsdp_reshard_after_forward: bool = True  # parallel.fsdp_reshard_after_forward
    ep: int = 1  # parallel.ep: an MoE model's routed experts split over ep of the dp_shard x cp GPUs

    def __post_init__(self) -> None:
        _check_choice("strategy", self.strategy, STRATEGIES)
        _check_choice("recompute", self.recompute, RECOMPUTE_POLICIES)
        _check_choice("precision", self.precision, PRECISION_MODES)
        _check_choice("pp_schedule", self.pp_schedule, PP_SCHEDULES)
        counts = ("seq_len", "micro_batch", "world_size", "grad_accum", "tp", "pp", "dp_replicate", "pp_virtual_stages",
                  "cp")
        for key in counts:
            if getattr(self, key) < 1:
                raise EstimatorError(f"{key} must be >= 1 (got {getattr(self, key)})")
        self._check_layout()
        if self.strategy == "none" and self.dp > 1:
            raise EstimatorError(
                f"strategy=none has no data parallelism; {self.dp} data-parallel ranks (world_size="
                f"{self.world_size} / (tp*pp)) needs ddp, zero1-3 or fsdp"
            )
        if self.precision == "fp8" and self.device.fp8_tflops is None:
            raise EstimatorError(f"precision=fp8 needs FP8 tensor cores; {self.device.name} has none (use bf16_master)")

    def _check_layout(self) -> None:
        cfg, t, p, v = self.model, self.tp, self.pp, self.pp_virtual_stages
        if self.world_size % (t * p * self.cp * self.dp_replicate):
            names = "tp*pp*cp*dp_replicate" if self.cp > 1 else "tp*pp*dp_replicate"
            raise EstimatorError(f"world_size={self.world_size} is not divisible by {names}="
                                 f"{t * p * self.cp * self.dp_replicate}")
        if self.seq_len % (2 * self.cp):
            raise EstimatorError(f"cp={self.cp} splits each sequence into 2*cp chunks: seq_len={self.seq_len} must "
                                 f"divide by {2 * self.cp}")
        if cfg.n_head % t or cfg.kv_heads % t:
            raise EstimatorError(f"tp={t} must divide model.n_head={cfg.n_head} and the KV heads ({cfg.kv_heads})")
        if cfg.n_layer % (p * v):
            raise EstimatorError(
                f"pp*pp_virtual_stages={p}*{v} must divide model.n_layer={cfg.n_layer} (equal stages)"
            )
        if v > 1 and self.pp_schedule not in MULTI_CHUNK_SCHEDULES:
            raise EstimatorError(
                f"pp_virtual_stages={v} needs pp_schedule in {', '.join(MULTI_CHUNK_SCHEDULES)} "
                f"(pp_schedule={self.pp_schedule} runs one chunk per GPU)"
            )
        if self.pp_schedule == "interleaved_1f1b" and p > 1 and v < 2:
            raise EstimatorError("pp_schedule=interleaved_1f1b needs pp_virtual_stages >= 2")
        problem = torch_microbatch_rule(self.pp_schedule, p, self.grad_accum)
        if problem:
            raise EstimatorError(problem)
        if self.dp_replicate > 1 and self.strategy not in ("zero3", "fsdp"):
            raise EstimatorError(f"dp_replicate={self.dp_replicate} (HSDP) needs strategy=fsdp, not {self.strategy}")
        if self.ep < 1:
            raise EstimatorError(f"ep must be >= 1 (got {self.ep})")
        if self.ep > 1:
            if cfg.moe.experts is None or cfg.moe.experts % self.ep:
                raise EstimatorError(f"ep={self.ep} must divide the model's routed experts ({cfg.moe.experts})")
            if self.cp > 1 and self.ep % self.cp:
                raise EstimatorError(f"ep={self.ep} must be a multiple of cp={self.cp}: an expert-parallel group spans "
                                     "whole context-parallel groups")
            if self.shard_group % self.ep:
                gpus = "dp_shard x cp" if self.cp > 1 else "dp_shard"
                raise EstimatorError(f"ep={self.ep} must divide the {self.shard_group} {gpus} GPUs it is carved out of")

    @property
    def dp(self) -> int:
        """Data-parallel ranks (dp_replicate x dp_shard): how many micro-batches run side by side."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def shard_group(self) -> int:
        """GPUs that shard the model states and average gradients together: dp_shard, with the cp
        ranks folded in (they hold the same weights and see different tokens, parallel/dims.py)."""
        return self.dp_shard * self.cp

    @property
    def config_dp_shard(self) -> int:
        """parallel.dp_shard as the trainer's config counts it: with ep, the GPUs holding the same
        experts (ep is carved out of dp_shard x cp, parallel/dims.py)."""
        return self.shard_group // self.ep if self.ep > 1 else self.dp_shard

    @property
    def local_seq_len(self) -> int:
        """Tokens of each sequence on one GPU (seq_len / cp): what activations scale with."""
        return self.seq_len // self.cp

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (it only means something with tp > 1)."""
        return self.tp > 1 and self.sequence_parallel is not False

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all GPUs."""
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def attention(self) -> str:
        # sdpa and flash_attn never store the scores on a GPU; only the reference backend does.
        return ATTENTION_BACKEND_KIND[self.model.attention]

    @property
    def activation_dtype_bytes(self) -> int:
        return ACTIVATION_BYTES[self.precision]
