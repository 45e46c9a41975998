"""ParallelConfig: how a built model is spread over processes."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from common.errors import ConfigError
from common.fields import doc
from parallel.layout import Layout, check_section
from parallel.nccl import validate_nccl_env


@dataclass
class ParallelConfig:
    strategy: Literal["none", "ddp", "fsdp", "zero1", "zero2", "zero3"] = doc(
        "none", "data-parallel strategy applied to the built model"
    )
    # --- layout (layout.py): ranks = pp x dp_replicate x dp_shard x cp x tp, tp innermost (inside a node);
    # ep is carved out of dp_shard x cp. Layout.of turns these keys and the world size into the run's layout.
    tp: int = doc(1, "tensor-parallel degree: each layer's matmuls split over this many ranks of a node "
                  "(Megatron-LM); must divide the heads, KV heads, d_ff and vocabulary. MoE layers are not split "
                  "(etp=1): replicated over the tp ranks, each routing its own sequence slice under "
                  "sequence_parallel")
    pp: int = doc(1, "pipeline-parallel stages: the layers split over this many ranks")
    cp: int = doc(1, "context-parallel degree: every sequence split over this many ranks (2*cp load-balanced "
                  "chunks, keys and values all-gathered per layer; parallel/cp.py); needs strategy=fsdp or none")
    ep: int = doc(1, "expert-parallel degree: an MoE model's routed experts split over this many of the dp_shard x cp "
                  "ranks (each holds model.moe.experts / ep), tokens sent to their experts and back by all-to-all "
                  "(parallel/ep.py); the dp_shard x cp / ep ranks holding the same experts shard them (FSDP2). With "
                  "cp > 1 it must be a multiple of cp (an ep group spans whole cp groups); with tp, each tp rank "
                  "exchanges its own tokens in its ep group (experts replicated over tp, or split by etp); must divide "
                  "model.moe.experts; needs strategy=fsdp or none")
    etp: int = doc(1, "expert tensor parallelism: 1 (routed experts replicated over the tp ranks) or tp (each "
                   "expert's matrices split over the tp ranks as a dense MLP's are: gate and up by columns, down by "
                   "rows, the experts' output all-reduced over tp; the shared experts split alike, the router "
                   "replicated, every tp rank routing the whole micro-batch). Composes with ep (each ep rank's "
                   "experts split over tp) and FSDP2; must divide model.moe.d_ff")
    dp_replicate: int = doc(1, "data-parallel replicas; with strategy=fsdp the replicate dimension of HSDP "
                            "(across nodes)")
    dp_shard: int = doc(-1, "data-parallel ranks that shard the model (fsdp) or hold replicas (ddp, zero), the "
                        "ep ranks among them: pp x dp_replicate x dp_shard x cp x tp = the world size; -1: every "
                        "rank the other dimensions leave")
    sequence_parallel: bool = doc(True, "with tp > 1: norms, dropout and the residual stream split over the "
                                  "sequence too (Korthikanti et al. 2022); activations / tp")
    loss_parallel: bool = doc(True, "with tp > 1: cross-entropy on vocab-sharded logits, never gathered whole")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = doc(
        "1f1b", "pipeline schedule; train.grad_accum_steps is the number of pipeline micro-batches"
    )
    pp_virtual_stages: int = doc(1, "stages per pipeline rank (interleaved_1f1b and zero_bubble: >= 2 shrinks "
                                 "the bubble by this factor)")
    # --- end layout (its rules: parallel/layout.py check_section)
    backend: Literal["auto", "nccl", "gloo"] = doc("auto", "process-group backend; auto: nccl on CUDA, gloo on CPU")
    timeout_s: int = doc(600, "collective timeout: a rank that dies makes the others fail within this")

    # --- communication (comm.py, compression.py, nccl.py)
    ddp_comm_hook: Literal["none", "hierarchical", "topk", "onebit", "powersgd", "bf16"] = doc(
        "none",
        "DDP gradient comm hook: none (DDP's all-reduce) | hierarchical (two-level all-reduce) | "
        "topk / onebit (compressed, with error feedback) | powersgd (PyTorch's) | bf16 (PyTorch's)",
    )
    topk_ratio: float = doc(
        0.01, "topk: fraction of each bucket's entries sent; pays only below ~2/(3*world) (tools/comm_model.py)"
    )
    powersgd_rank: int = doc(1, "powersgd: matrix approximation rank")
    powersgd_start_iter: int = doc(10, "powersgd: steps of plain all-reduce before compressing (>= 2)")
    local_world_size: int | None = doc(
        None, "ranks per node for hierarchical collectives; default: env LOCAL_WORLD_SIZE (set by torchrun)"
    )
    nccl: dict[str, str] = doc(
        {}, "NCCL environment variables set before the process group is created; documented names only"
    )
    flight_recorder: bool = doc(
        False, "NCCL: PyTorch's Flight Recorder keeps the last collectives of every rank in a ring buffer and "
        "dumps it on a collective timeout to <run_dir>/flight_recorder/rank_<R> (TORCH_FR_* / TORCH_NCCL_* "
        "variables, set before the process group starts)"
    )

    def _validate_communication(self) -> None:
        if self.ddp_comm_hook != "none" and self.strategy != "ddp":
            raise ConfigError(
                f"parallel.ddp_comm_hook={self.ddp_comm_hook} is a DDP comm hook; set parallel.strategy=ddp "
                "or parallel.ddp_comm_hook=none"
            )
        if not 0.0 < self.topk_ratio <= 1.0:
            raise ConfigError(f"parallel.topk_ratio must be in (0, 1], got {self.topk_ratio}")
        if self.powersgd_rank < 1:
            raise ConfigError(f"parallel.powersgd_rank must be >= 1, got {self.powersgd_rank}")
        if self.powersgd_start_iter < 2:
            raise ConfigError(
                f"parallel.powersgd_start_iter must be >= 2 (DDP rebuilds its buckets after step 1), "
                f"got {self.powersgd_start_iter}"
            )
        if self.local_world_size is not None and self.local_world_size < 1:
            raise ConfigError(f"parallel.local_world_size must be >= 1 or null, got {self.local_world_size}")
        validate_nccl_env(self.nccl)
    # --- end communication

    # --- strategies (ddp.py, fsdp.py, zero.py)
    ddp_bucket_cap_mb: float = doc(
        25.0, "DDP gradient bucket size in MB: each full bucket is all-reduced while backward goes on"
    )
    ddp_gradient_as_bucket_view: bool = doc(
        True, "DDP: .grad tensors are views into the buckets (saves one gradient-sized copy)"
    )
    ddp_static_graph: bool = doc(
        False, "DDP: the model uses the same parameters every step (lets DDP skip per-step bookkeeping)"
    )
    fsdp_reshard_after_forward: bool = doc(
        True, "FSDP2: free each block's gathered weights after forward and re-gather in backward; "
        "false keeps them (more memory, one all-gather less per block); pp_schedule=zero_bubble always keeps them"
    )
    fsdp_forward_prefetch: int = doc(
        0, "FSDP2: blocks whose all-gather each block issues ahead in forward (0: none, FSDP2's default)"
    )
    fsdp_backward_prefetch: int = doc(
        1, "FSDP2: blocks whose all-gather each block issues ahead in backward (1: FSDP2's default)"
    )
    fsdp_cpu_offload: bool = doc(
        False, "FSDP2: keep parameter, gradient and optimizer shards in CPU memory (the optimizer steps on CPU)"
    )
    fsdp_hybrid: bool = doc(
        False, "FSDP2 as HSDP: shard within a node, replicate across nodes (2-D mesh nodes x local ranks; "
        "ranks per node from parallel.local_world_size or LOCAL_WORLD_SIZE)"
    )
    init_on_meta: bool = doc(
        False, "fsdp only: build the model on the meta device, shard it, then allocate and init_weights() "
        "each shard (no rank ever holds the full model; expert-parallel experts too); the random init then differs "
        "from a 1-process run"
    )
    zero_offload_optimizer: bool = doc(
        False, "zero1/2/3: keep the fp32 master weights and optimizer state in CPU memory (DeepSpeed offload)"
    )
    zero_offload_params: bool = doc(False, "zero3 only: keep parameter partitions in CPU memory (DeepSpeed offload)")
    zero_cpu_adam: bool = doc(
        True, "with zero_offload_optimizer: DeepSpeed's vectorized CPU Adam (JIT-compiled on first use, ~1 min); "
        "false: torch AdamW on the CPU copies (no build, slower steps)"
    )

    def _validate_strategies(self) -> None:
        if self.ddp_bucket_cap_mb <= 0:
            raise ConfigError(f"parallel.ddp_bucket_cap_mb must be > 0, got {self.ddp_bucket_cap_mb}")
        if self.fsdp_forward_prefetch < 0:
            raise ConfigError(f"parallel.fsdp_forward_prefetch must be >= 0, got {self.fsdp_forward_prefetch}")
        if self.fsdp_backward_prefetch < 1:
            raise ConfigError(
                f"parallel.fsdp_backward_prefetch must be >= 1 (1 is FSDP2's default), got {self.fsdp_backward_prefetch}"
            )
        if self.init_on_meta and self.strategy != "fsdp":
            raise ConfigError(
                f"parallel.init_on_meta needs parallel.strategy=fsdp (got {self.strategy}): only sharded "
                "models are materialized shard by shard"
            )
        fsdp_only = [k for k in ("fsdp_cpu_offload", "fsdp_hybrid") if getattr(self, k)]
        if fsdp_only and self.strategy != "fsdp":
            raise ConfigError(f"parallel.{fsdp_only[0]} needs parallel.strategy=fsdp (got {self.strategy})")
        zero_only = [k for k in ("zero_offload_optimizer", "zero_offload_params") if getattr(self, k)]
        if zero_only and not self.strategy.startswith("zero"):
            raise ConfigError(f"parallel.{zero_only[0]} needs parallel.strategy=zero1, zero2 or zero3 (got {self.strategy})")
        if self.zero_offload_params and self.strategy != "zero3":
            raise ConfigError(
                f"parallel.zero_offload_params needs parallel.strategy=zero3 (got {self.strategy}): "
                "only stage 3 partitions parameters"
            )
    # --- end strategies

    def validate(self) -> None:
        if self.timeout_s < 1:
            raise ConfigError("parallel.timeout_s must be >= 1")
        check_section(self)
        self._validate_communication()
        self._validate_strategies()

    @property
    def reshard_blocks_after_forward(self) -> bool:
        """Whether FSDP2 frees a block's gathered weights after its forward. Not in a zero_bubble
        pipeline: the input half of its split backward lists the stage's weights by the module's
        parameters at that moment, and a resharded block shows its shards there, not the gathered
        weights forward used, so the weight half would skip the block (its gradients stayed None).
        Kept gathered, they are freed by the schedule's gradient reduction at the end of the step."""
        if self.pp > 1 and self.pp_schedule == "zero_bubble":
            return False
        return self.fsdp_reshard_after_forward

    def resolved(self, layout: Layout) -> tuple[ParallelConfig, str | None]:
        """This section with the strategy ``layout`` runs (``resolve_strategy``), and a log line if
        that changed it."""
        return replace(self, strategy=layout.strategy), layout.strategy_note(self.strategy)
