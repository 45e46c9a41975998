"""DeepSpeed ZeRO stages 1-3 as an ``Engine`` (parallel/engine.py); the one deepspeed import.

ZeRO partitions what DDP replicates (Rajbhandari et al., 2020): stage 1 the optimizer state
(with the fp32 master weights), stage 2 also the gradients, stage 3 also the parameters.
DeepSpeed does the work; this module only translates our config into a DeepSpeed config and
drives the DeepSpeed engine:

- micro-steps go through ``engine.backward`` and ``engine.step`` once per micro-batch, so
  DeepSpeed's own gradient-accumulation boundary logic (reduce, then step on the last one)
  runs as designed; the learning rate of the step is set just before the boundary ``step``;
- precision: fp32 -> no section; bf16 (autocast, fp32 weights) -> ``torch_autocast``;
  bf16_master -> ``bf16`` (bf16 weights, fp32 master partitions); fp16 -> ``fp16`` with
  dynamic loss scaling (fp16 weights, fp32 masters: DeepSpeed's design, not torch AMP);
- non-finite steps: DeepSpeed checks gradients for inf/NaN and skips the step itself (fp16
  overflow, and with ``check_grad_overflow`` for bf16); a skipped step is reported as
  ``StepResult.skipped``;
- the optimizer is our torch AdamW handed to ``deepspeed.initialize``, which avoids the JIT
  build of DeepSpeed's fused/CPU Adam. With optimizer offload DeepSpeed wants its vectorized
  ``DeepSpeedCPUAdam`` (compiled with ninja/g++ on first use, about a minute, cached under
  TORCH_EXTENSIONS_DIR); ``parallel.zero_cpu_adam=false`` keeps torch AdamW instead;
- checkpoints: DeepSpeed's ``save_checkpoint``/``load_checkpoint`` into the directory our
  atomic saver hands over (tag ``deepspeed``; every rank writes its own partitions). DeepSpeed's
  own loader unpickles its files with ``torch.load(weights_only=False)``; ours swaps in a loader
  that reads them weights-only, allowing just the few DeepSpeed classes its ZeRO files hold, so
  a crafted checkpoint cannot run code.

DeepSpeed's ``TorchBackend`` JIT-builds its ``deepspeed_shm_comm`` op (~40 s) on a CPU machine
the first time it starts; that op only serves ``inference_all_reduce`` (DeepSpeed inference),
never training, so on CPU we mark it unavailable before DeepSpeed looks for it.
"""

from __future__ import annotations

import functools
import math
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from common.errors import CapabilityError, CheckpointError, ConfigError
from model.mup import lr_multipliers
from parallel.api_floors import install_floor
from parallel.config import ParallelConfig
from parallel.engine import Engine, unwrap
from parallel.optim import OptimConfig, build_adamw, decay_groups
from parallel.precision import PrecisionPolicy
from parallel.step import OptimizedPart, StepResult, set_lr

CHECKPOINT_TAG = "deepspeed"
ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}


# --------------------------------------------------------------------------- the DeepSpeed config


def deepspeed_config(parallel_cfg: ParallelConfig, policy: PrecisionPolicy, optim_cfg: OptimConfig, *,
                     micro_batch_size: int, grad_accum_steps: int, world_size: int) -> dict[str, Any]:
    """Our config sections as a DeepSpeed config dict (pure: no DeepSpeed import, unit-testable)."""
    p = parallel_cfg
    if p.strategy not in ZERO_STAGES:
        raise ConfigError(f"parallel.strategy={p.strategy} is not a ZeRO stage; choose zero1, zero2 or zero3")
    bucket = int(p.ddp_bucket_cap_mb * 2**20 / 4)  # DeepSpeed counts bucket sizes in elements
    zero: dict[str, Any] = {
        "stage": ZERO_STAGES[p.strategy],
        "overlap_comm": False,  # on gloo/CPU a side stream buys nothing; GPUs may turn it on
        "contiguous_gradients": True,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
    }
    if p.zero_offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if p.zero_offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": micro_batch_size * grad_accum_steps * world_size,
        "gradient_clipping": optim_cfg.grad_clip,
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,  # our logger reports; DeepSpeed's own step prints stay off
        "wall_clock_breakdown": False,
    }
    if p.zero_offload_optimizer and not p.zero_cpu_adam:
        ds["zero_force_ds_cpu_optimizer"] = False  # lets torch AdamW step the offloaded masters
    ds.update(_precision_section(policy))
    return ds


def _precision_section(policy: PrecisionPolicy) -> dict[str, Any]:
    mode = policy.mode
    if mode == "fp32":
        return {}
    if mode == "bf16":
        return {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    if mode == "bf16_master":
        return {"bf16": {"enabled": True, "check_grad_overflow": True}}
    if mode == "fp16":
        return {"fp16": {"enabled": True, "loss_scale": 0,  # 0: dynamic
                         "initial_scale_power": int(round(math.log2(policy.config.fp16_init_scale)))}}
    raise ConfigError(f"precision.mode={mode} is not supported with DeepSpeed ZeRO; use fp32, bf16, bf16_master or fp16")


# --------------------------------------------------------------------------- start-up


def import_deepspeed(device: torch.device):
    """Import DeepSpeed for this device, or fail with the install line."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read once, at DeepSpeed's first import
    try:
        import deepspeed
    except ImportError as exc:
        raise CapabilityError(
            f"parallel.strategy=zero* needs DeepSpeed ({exc}); pip install '{install_floor('deepspeed')}' "
            "or pip install -e .[deepspeed]"
        ) from None
    if device.type == "cpu":
        _skip_shm_comm_build(deepspeed)
    return deepspeed


def _skip_shm_comm_build(deepspeed) -> None:
    """Tell DeepSpeed its shared-memory inference all-reduce op is unavailable (saves a ~40 s
    compile on the first CPU run). Training collectives go through torch.distributed either way."""
    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


def apply_zero(model: nn.Module, parallel_cfg: ParallelConfig, policy: PrecisionPolicy, optim_cfg: OptimConfig, *,
               micro_batch_size: int, grad_accum_steps: int, world_size: int, device: torch.device) -> ZeroEngine:
    """Hand ``model`` to DeepSpeed (collective: every rank calls this) and return its engine."""
    deepspeed = import_deepspeed(device)
    _check_precision_supported(policy.mode)
    ds_config = deepspeed_config(parallel_cfg, policy, optim_cfg, micro_batch_size=micro_batch_size,
                                 grad_accum_steps=grad_accum_steps, world_size=world_size)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = _optimizer(decay_groups(params, optim_cfg.weight_decay, lr_multipliers(model)), parallel_cfg, optim_cfg,
                           device)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                           dist_init_required=False)
    return ZeroEngine(engine, policy, device)


def _check_precision_supported(mode: str) -> None:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if mode == "fp16" and not accelerator.is_fp16_supported():
        raise CapabilityError(
            f"precision.mode=fp16 with DeepSpeed: its {accelerator.device_name()} accelerator has no fp16 "
            "support here; use bf16_master (or bf16) with ZeRO on this machine"
        )


def _optimizer(groups: list[dict], parallel_cfg: ParallelConfig, o: OptimConfig,
               device: torch.device) -> torch.optim.Optimizer:
    if parallel_cfg.zero_offload_optimizer and parallel_cfg.zero_cpu_adam:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                                adamw_mode=True)
    # Fused AdamW cannot step parameters DeepSpeed keeps on another device (offload): off there.
    return build_adamw(groups, o, device, allow_fused=not parallel_cfg.zero_offload_optimizer)


# --------------------------------------------------------------------------- the engine


class ZeroEngine(Engine):
    """The Engine interface over a DeepSpeed engine."""

    def __init__(self, ds_engine, policy: PrecisionPolicy, device: torch.device):
        self.engine, self.policy, self.device = ds_engine, policy, device
        self.model = ds_engine
        load_checkpoints_weights_only(ds_engine)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, is_last_micro: bool, n_micro: int) -> torch.Tensor:
        if n_micro != self.engine.gradient_accumulation_steps():
            raise ValueError(f"{n_micro} micro-batches per step, but DeepSpeed was configured with "
                             f"{self.engine.gradient_accumulation_steps()} (train.grad_accum_steps)")
        self.mark_phase("forward")
        loss = self.engine(x, y)
        self.mark_phase("backward")
        self.engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
        if not is_last_micro:
            self.engine.step()  # not a boundary: DeepSpeed only counts the micro-step
        return loss.detach().float()

    def optimizer_step(self, lr: float, loss: torch.Tensor) -> StepResult:
        """The learning rate, then DeepSpeed's own step. The torch engines' shared step
        (parallel/step.py) cannot drive a ZeRO optimizer: the gradients sit in DeepSpeed's
        partitioned buffers and the fp32 masters in its flat partitions, which only
        ``engine.step()`` reads; it clips (``gradient_clipping``), checks for overflow, skips, and
        runs its own loss scaler. Its grad norm comes back as a host float (a sync per step)."""
        if not self.engine.is_gradient_accumulation_boundary():
            raise RuntimeError("optimizer_step called before the last micro-batch of the step")
        set_lr(self.engine.optimizer, lr)
        self.engine.step()
        skipped = not self.engine.was_step_applied()
        norm = self.engine.get_global_grad_norm()
        grad_norm = torch.tensor(float("nan") if norm is None else float(norm))
        return StepResult(grad_norm=grad_norm, skipped=skipped, loss_scale=self._loss_scale())

    def _loss_scale(self) -> float | None:
        if self.policy.mode != "fp16":
            return None
        return float(self.engine.optimizer.cur_scale)  # ZeRO optimizers' dynamic loss scale

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.engine(x, y).detach().float()

    def train(self, mode: bool = True) -> None:
        self.engine.train(mode)

    def comm_stats(self) -> dict[str, float]:
        return {}  # DeepSpeed's collectives are not counted (no comm hook)

    def local_weights(self) -> list[torch.Tensor]:
        """Under ZeRO-3 ``param.data`` is an empty placeholder and the rank's slice lives in
        ``param.ds_tensor``, padded at the end with uninitialized memory that must not be read
        (garbage there would look like a NaN)."""
        tensors = []
        for param in self.engine.module.parameters():
            ds_tensor = getattr(param, "ds_tensor", None)
            if ds_tensor is None:
                tensors.append(param.detach())
                continue
            part = ds_tensor.numel()
            rank = getattr(param, "ds_zero_partition_rank", 0)  # the rank within the partition group
            valid = max(0, min(part, getattr(param, "ds_numel", part) - part * rank))
            tensors.append(ds_tensor.detach().view(-1).narrow(0, 0, valid))
        return [t for t in tensors if t.numel() > 0]

    def module(self) -> nn.Module:
        return unwrap(self.engine.module)

    def optimized_parts(self) -> list[OptimizedPart]:
        """None: DeepSpeed's optimizer steps its own flat partitions (``optimizer_step``)."""
        return []

    # ----------------------------------------------------------------- checkpoint

    def save(self, directory: Path, rank: int) -> None:
        """Collective: every rank writes its partitions into ``directory/deepspeed``."""
        self.engine.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, client_state={}, save_latest=False)

    def load(self, directory: Path) -> None:
        if not (Path(directory) / CHECKPOINT_TAG).is_dir():
            raise CheckpointError(f"no DeepSpeed checkpoint in {directory} (missing {CHECKPOINT_TAG}/); was it "
                                  "saved with a parallel.strategy=zero* run?")
        path, _ = self.engine.load_checkpoint(str(directory), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load the checkpoint in {directory}/{CHECKPOINT_TAG}")


# --------------------------------------------------------------------------- loading without running code


def load_checkpoints_weights_only(ds_engine) -> None:
    """Make ``ds_engine.load_checkpoint`` unpickle every file weights-only.

    Every file DeepSpeed reads on our load path (model states, ZeRO optimizer partitions) goes
    through its checkpoint engine's ``load``; the default engine is swapped in place (its state is
    kept) for a subclass whose ``load`` is ``load_deepspeed_file``.
    """
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    current = getattr(ds_engine, "checkpoint_engine", None)
    if current is None or isinstance(current, _weights_only_engine_class()):
        return
    if type(current) is not TorchCheckpointEngine:  # a DeepSpeed config we never generate
        raise CapabilityError(f"DeepSpeed uses {type(current).__name__} for checkpoints; perfgpt only loads through "
                              "its default TorchCheckpointEngine (remove the checkpoint engine settings)")
    current.__class__ = _weights_only_engine_class()


@functools.cache
def _weights_only_engine_class() -> type:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            return load_deepspeed_file(Path(path), map_location)

    return WeightsOnlyCheckpointEngine


def deepspeed_checkpoint_classes() -> list[type]:
    """The classes ZeRO checkpoint files pickle besides tensors and plain containers, as DeepSpeed
    0.19.8 writes them (each exists from 0.17.2, the floor): the loss scaler, the stage enum and
    bf16 fragment addresses. Rebuilding them only sets fields. A release that pickles more is
    refused in one line naming the class."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_deepspeed_file(path: Path, map_location=None) -> Any:
    """``torch.load(weights_only=True)`` with DeepSpeed's checkpoint classes allowed; anything else
    in the file is refused in one line before it is built."""
    try:
        with torch.serialization.safe_globals(deepspeed_checkpoint_classes()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"would call {found.group(1)}" if found else "is not a DeepSpeed checkpoint file"
        raise CheckpointError(f"refusing to load {path}: it {what}, which DeepSpeed checkpoints never hold "
                              "(a crafted or foreign file)") from None
    except (OSError, RuntimeError, EOFError, ValueError) as exc:  # truncated or garbled files
        text = str(exc).strip()
        first = (text.splitlines()[0] if text else type(exc).__name__)[:200]
        raise CheckpointError(f"cannot read DeepSpeed checkpoint file {path}: {first}") from None


def read_zero_model_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The whole fp32 model of the ZeRO checkpoint in ``directory`` (any stage, any rank count),
    keyed by parameter name: DeepSpeed's own consolidation (``zero_to_fp32``), with every file it
    reads unpickled weights-only and only DeepSpeed's checkpoint classes allowed."""
    if not (Path(directory) / CHECKPOINT_TAG).is_dir():
        raise CheckpointError(f"no DeepSpeed checkpoint in {directory} (missing {CHECKPOINT_TAG}/)")
    import_deepspeed(torch.device("cpu"))
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # zero_to_fp32 passes weights_only=False to torch.load; torch's switch overrides that for the
    # duration of this call (it reads the variable at every load).
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(deepspeed_checkpoint_classes()):
            state = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=CHECKPOINT_TAG)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"would call {found.group(1)}" if found else "is not a DeepSpeed checkpoint"
        raise CheckpointError(f"refusing to read {directory}/{CHECKPOINT_TAG}: a file {what}, which DeepSpeed "
                              "checkpoints never hold (a crafted or foreign file)") from None
    except (OSError, RuntimeError, EOFError, ValueError, KeyError) as exc:
        text = str(exc).strip()
        first = (text.splitlines()[0] if text else type(exc).__name__)[:200]
        raise CheckpointError(f"cannot consolidate the DeepSpeed checkpoint in {directory}: {first}") from None
    finally:
        if previous is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous
    return {name: tensor.detach().clone() for name, tensor in state.items()}
