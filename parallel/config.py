"""ParallelConfig: how a built model is spread over processes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from training.fields import ConfigError, doc


@dataclass
class ParallelConfig:
    strategy: Literal["none", "ddp", "fsdp", "zero1", "zero2", "zero3"] = doc(
        "none", "data-parallel strategy applied to the built model"
    )
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

    def _validate_communication(self) -> None:
        from parallel.nccl import validate_nccl_env

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

    def validate(self) -> None:
        if self.timeout_s < 1:
            raise ConfigError("parallel.timeout_s must be >= 1")
        self._validate_communication()
