"""The chapter's models (``--preset`` of tools/estimate.py), listed in presets.yaml beside this file.

A preset whose model ships as a config (``configs/*.yaml``) reads it from there, so the two never
drift apart; the others keep their published shape in presets.yaml. Either way the model section is
read and checked as the trainer reads a config's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from analysis.estimator.job import EstimatorError
from model.config import ModelConfig
from training.config import from_dict, load_config

ROOT = Path(__file__).resolve().parents[2]  # the repository: config paths are relative to it
TABLE = Path(__file__).with_name("presets.yaml")


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    model: ModelConfig
    seq_len: int
    micro_batch: int
    world_size: int
    device: str


@functools.cache
def _table() -> dict[str, dict[str, Any]]:
    return yaml.safe_load(TABLE.read_text())


PRESET_NAMES = tuple(_table())


def preset(name: str) -> Preset:
    """The configurations the chapter's tables talk about (fresh objects on every call)."""
    if name not in PRESET_NAMES:
        raise EstimatorError(f"unknown preset {name!r}; choose one of: {', '.join(PRESET_NAMES)}")
    entry = _table()[name]
    if "config" in entry:
        cfg = load_config(ROOT / entry["config"])
        model, seq_len, micro_batch = cfg.model, cfg.seq_len, cfg.train.micro_batch_size
    else:
        model = from_dict(ModelConfig, dict(entry["model"]), prefix="model.")
        model.validate()
        seq_len, micro_batch = entry["seq_len"], entry["micro_batch"]
    return Preset(name, entry["description"], model, seq_len, micro_batch, entry["world_size"], entry["device"])
