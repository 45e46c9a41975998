"""ParallelConfig: how a built model is spread over processes."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from common.errors import ConfigError
from common.fields import doc
from parallel.nccl import validate_nccl_env


@dataclass
class ParallelConfig:
    strategy: Literal["none", "ddp", "fsdp", "zero1", "zero2", "zero3"] = doc(
        "none", "data-parallel strategy applied to the built model"
    )
    # --- layout (dims.py): ranks = pp x dp_replicate x dp_shard x ep x cp x tp, tp innermost (inside a node);
    # ep ranks are data-parallel ranks for the dense weights (ParallelDims' dp_shard counts them); with
    # cp > 1 the cp ranks are among the ep ranks: pp x dp_replicate x dp_shard x ep x tp
    tp: int = doc(1, "tensor-parallel degree: each layer's matmuls split over this many ranks of a node "
                  "(Megatron-LM); must divide the heads, KV heads, d_ff and vocabulary. MoE layers are not split: "
                  "replicated over the tp ranks, each routing its own sequence slice under sequence_parallel")
    pp: int = doc(1, "pipeline-parallel stages: the layers split over this many ranks")
    cp: int = doc(1, "context-parallel degree: every sequence split over this many ranks (2*cp load-balanced "
                  "chunks, keys and values all-gathered per layer; parallel/cp.py); needs strategy=fsdp or none")
    ep: int = doc(1, "expert-parallel degree: an MoE model's routed experts split over this many data-parallel "
                  "ranks (each holds model.moe.experts / ep), tokens sent to their experts and back by all-to-all "
                  "(parallel/ep.py). Carved out of data parallelism x cp: the dense weights shard over dp_shard x "
                  "ep ranks, the experts over dp_shard; with cp > 1 it must be a multiple of cp (an ep group spans "
                  "whole cp groups: dp_shard x ep ranks in all, the cp ranks among them); with tp, each tp rank "
                  "exchanges its own tokens in its ep group (experts replicated over tp); must divide "
                  "model.moe.experts; needs strategy=fsdp or none")
    dp_replicate: int = doc(1, "data-parallel replicas; with strategy=fsdp the replicate dimension of HSDP "
                            "(across nodes)")
    dp_shard: int = doc(-1, "data-parallel ranks that shard the model (fsdp) or hold replicas (ddp, zero); "
                        "-1: every rank the other dimensions leave; with ep > 1 the ranks holding the same experts "
                        "(ep x dp_shard ranks shard the dense weights, cp ranks among them when cp > 1)")
    sequence_parallel: bool = doc(True, "with tp > 1: norms, dropout and the residual stream split over the "
                                  "sequence too (Korthikanti et al. 2022); activations / tp")
    loss_parallel: bool = doc(True, "with tp > 1: cross-entropy on vocab-sharded logits, never gathered whole")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"] = doc(
        "1f1b", "pipeline schedule; train.grad_accum_steps is the number of pipeline micro-batches"
    )
    pp_virtual_stages: int = doc(1, "stages per pipeline rank (interleaved_1f1b and zero_bubble: >= 2 shrinks "
                                 "the bubble by this factor)")

    def _validate_layout(self) -> None:
        for key in ("tp", "pp", "cp", "ep", "dp_replicate", "pp_virtual_stages"):
            if getattr(self, key) < 1:
                raise ConfigError(f"parallel.{key} must be >= 1 (got {getattr(self, key)})")
        if self.dp_shard != -1 and self.dp_shard < 1:
            raise ConfigError(f"parallel.dp_shard must be >= 1, or -1 for the ranks left over (got {self.dp_shard})")
        if self.pp == 1:  # pipeline keys without a pipeline would be ignored: say so instead
            unused = [f"pp_schedule={self.pp_schedule}" if self.pp_schedule != "1f1b" else "",
                      f"pp_virtual_stages={self.pp_virtual_stages}" if self.pp_virtual_stages != 1 else ""]
            unused = [u for u in unused if u]
            if unused:
                raise ConfigError(f"parallel.{unused[0]} has no effect with parallel.pp=1 (no pipeline): set "
                                  "parallel.pp > 1, or leave the pipeline keys at their defaults")
        if self.pp_schedule in ("gpipe", "1f1b") and self.pp_virtual_stages != 1:
            raise ConfigError(f"parallel.pp_schedule={self.pp_schedule} runs one stage per rank; set "
                              "parallel.pp_virtual_stages=1 or an interleaved schedule")
        if self.pp_schedule == "interleaved_1f1b" and self.pp > 1 and self.pp_virtual_stages < 2:
            raise ConfigError("parallel.pp_schedule=interleaved_1f1b needs parallel.pp_virtual_stages >= 2 "
                              "(with one stage per rank it is 1f1b)")
        model_parallel = self.tp > 1 or self.pp > 1
        if model_parallel and self.strategy in ("ddp", "zero1", "zero2", "zero3"):
            raise ConfigError(f"parallel.strategy={self.strategy} cannot wrap tensor- or pipeline-parallel models "
                              "(DTensor parameters, stages); use parallel.strategy=fsdp for their data parallelism")
        if self.cp > 1 and self.strategy not in ("none", "fsdp"):
            raise ConfigError(f"parallel.cp={self.cp} with parallel.strategy={self.strategy} is not supported: context-"
                              "parallel ranks reduce gradients through FSDP2's mesh; use parallel.strategy=fsdp")
        if self.ep > 1 and self.strategy not in ("none", "fsdp"):
            raise ConfigError(f"parallel.ep={self.ep} with parallel.strategy={self.strategy} is not supported: expert "
                              "parameters are sharded by FSDP2 over the ranks left after ep; use parallel.strategy=fsdp")
        if self.ep > 1 and self.cp > 1 and self.ep % self.cp:
            raise ConfigError(f"parallel.ep={self.ep} with parallel.cp={self.cp}: an expert-parallel group spans whole "
                              "context-parallel groups, so ep must be a multiple of cp; choose ep = cp x n")
        if self.ep > 1 and self.fsdp_hybrid:
            raise ConfigError(f"parallel.ep={self.ep} with parallel.fsdp_hybrid: set parallel.dp_replicate and "
                              "parallel.dp_shard instead")
        if self.fsdp_hybrid and (model_parallel or self.cp > 1 or self.dp_replicate != 1):
            raise ConfigError("parallel.fsdp_hybrid is the shorthand for dp_replicate=<nodes> without tp or pp; "
                              "set parallel.dp_replicate (and dp_shard) instead")
        if self.dp_replicate > 1 and self.strategy != "fsdp":
            raise ConfigError(f"parallel.dp_replicate={self.dp_replicate} is HSDP's replicate dimension: it needs "
                              f"parallel.strategy=fsdp (got {self.strategy}); other strategies replicate over dp_shard")
    # --- end layout
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
        self._validate_layout()
        self._validate_communication()
        self._validate_strategies()

    def layout(self, nodes: int, ranks_per_node: int) -> dict[str, int]:
        """The mesh degrees (ParallelDims' pp, dp_replicate, dp_shard, cp, tp) for this section; HSDP's
        shorthand ``fsdp_hybrid`` becomes one replica per node, sharded inside it."""
        if self.fsdp_hybrid:
            return {"pp": 1, "dp_replicate": nodes, "dp_shard": ranks_per_node, "tp": 1}
        # ParallelDims' dp_shard counts every rank the dense weights shard over, the ep ranks among them.
        # With cp, an ep group spans cp ranks and ep / cp dp_shard ranks (parallel/dims.py).
        dp_shard = self.dp_shard * (self.ep // min(self.cp, self.ep)) if self.dp_shard != -1 else -1
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": dp_shard, "cp": self.cp,
                "tp": self.tp, "ep": self.ep}

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

    def for_data_parallel(self, dp_size: int) -> tuple[ParallelConfig, str | None]:
        """This section as it applies to ``dp_size`` data-parallel ranks, and a log line if that
        changed it: strategy none on several data-parallel ranks would train unsynchronized
        replicas, so they get DDP (FSDP2 for tensor- or pipeline-parallel models, which DDP cannot wrap,
        and for context parallelism, whose ranks average gradients over FSDP2's mesh)."""
        if self.ep > 1 and self.strategy == "none":
            note = (f"parallel: strategy none with parallel.ep={self.ep} -> fsdp (expert and dense gradients "
                    "averaged through FSDP2's meshes)")
            return replace(self, strategy="fsdp"), note
        if self.cp > 1 and self.strategy == "none":
            note = (f"parallel: strategy none with parallel.cp={self.cp} -> fsdp (context-parallel ranks average "
                    "gradients as data-parallel ones do)")
            return replace(self, strategy="fsdp"), note
        if dp_size > 1 and self.strategy == "none":
            strategy = "ddp" if self.tp == 1 and self.pp == 1 else "fsdp"
            note = f"parallel: strategy none with {dp_size} data-parallel ranks -> {strategy} (gradients averaged)"
            return replace(self, strategy=strategy), note
        return self, None
