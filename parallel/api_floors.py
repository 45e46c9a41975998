"""The oldest release of each dependency that has every API this code calls, and where each
requirement comes from.

pyproject.toml's floors must not be lower than this table (a test compares them), so a change
that starts using a newer API adds a row here and raises the floor in the same change. These are
the releases where the APIs first appeared, looked up in each project's sources and release
history; they are not versions the test suite runs on (CI runs torch 2.13 and deepspeed 0.19.8).
An older release would not fail loudly: DeepSpeed before 0.17.2 ignores the ``torch_autocast``
section and trains in fp32, and flash-attn before 2.7 has no op for op_selective to keep.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ApiNeed:
    package: str  # distribution name as pyproject.toml spells it
    version: str  # first release that has the API
    api: str
    used_in: str


NEEDS: tuple[ApiNeed, ...] = (
    ApiNeed("torch", "2.6", "torch.distributed.fsdp.fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy "
            "(FSDP2's public home; earlier it lived under torch.distributed._composable)", "parallel/fsdp.py"),
    ApiNeed("torch", "2.5", "torch.serialization.safe_globals context manager", "parallel/zero.py"),
    ApiNeed("deepspeed", "0.17.2", "the torch_autocast config section (precision.mode=bf16 under ZeRO)",
            "parallel/zero.py"),
    ApiNeed("deepspeed", "0.17.1", "bf16.check_grad_overflow (skips non-finite bf16_master steps)", "parallel/zero.py"),
    ApiNeed("flash-attn", "2.7.0", "the torch op flash_attn::_flash_attn_forward, whose output op_selective keeps",
            "model/recompute.py"),
    ApiNeed("flash-attn", "2.3", "flash_attn_func and flash_attn_varlen_func's window_size (sliding windows)",
            "model/attention.py"),
    ApiNeed("transformers", "4.41", "LlamaConfig.mlp_bias: a Llama-layout export with biases loads with its MLP "
            "biases (older releases drop them)", "model/interop.py, tests/unit/model/test_interop.py"),
    ApiNeed("transformers", "4.55", "GptOssConfig and GptOssForCausalLM, the gpt-oss layout model/interop.py reads and "
            "writes", "tests/unit/model/test_model_families.py"),
    ApiNeed("torchao", "0.9", "Float8LinearConfig.from_recipe_name (the tensorwise and rowwise float8 training "
            "recipes by name)", "parallel/float8.py"),
    ApiNeed("lm-eval", "0.4.12", "TaskManager(include_defaults=...), TaskManager.task_index and "
            "lm_eval.tasks._yaml_loader.load_yaml (the harness's task index as rewritten in 0.4.12)",
            "training/lm_eval_backend.py"),
    ApiNeed("transformer-engine", "2.0", "transformer_engine.pytorch.checkpoint and TransformerLayer's "
            "attn_input_format", "model/te.py, model/recompute.py"),
)


def version_tuple(version: str) -> tuple[int, ...]:
    """'2.7.0.post2' -> (2, 7, 0), '2.6' -> (2, 6, 0); enough for the plain release numbers used here."""
    parts = [int(part) for part in re.findall(r"\d+", version.split("post")[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))


def minimum_version(package: str) -> str:
    """The floor ``package`` needs: the newest of the versions its rows name."""
    rows = [need.version for need in NEEDS if need.package == package]
    if not rows:
        raise KeyError(f"no API requirement recorded for {package}")
    return max(rows, key=version_tuple)


def install_floor(package: str) -> str:
    """``package>=X`` for install hints, so messages quote the same floor as pyproject.toml."""
    return f"{package}>={minimum_version(package)}"
