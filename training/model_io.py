"""A trained model, whoever wrote it, as one perfgpt model config and state dict, and out again.

Sources ``load_source`` reads:
- a perfgpt checkpoint, saved by any layout: a ``step_XXXXXXXX`` directory, a checkpoint root
  (its newest complete checkpoint) or a run directory (``<run>/checkpoints``). One process and
  DDP save ``model_optim.pt``; FSDP2 and the tensor/pipeline layouts ``dcp/``, read through
  parallel/checkpoint.py's verified reader, shards and stages joined; ZeRO-1/2/3 DeepSpeed's
  files, consolidated by DeepSpeed's ``zero_to_fp32`` with every file read weights-only. The
  checkpoint's meta.json holds the model config and the dataset's tokenizer;
- a ``.safetensors`` file written by ``tools/export.py --format safetensors`` (the same facts in
  its metadata);
- a Hugging Face GPT-2, Llama, Mistral, Qwen2, Mixtral, Qwen3-MoE or gpt-oss model directory, and a
  nanoGPT ``ckpt.pt`` (model/interop.py).

Weights leave as that safetensors file or as a Hugging Face directory (``write_export``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Collection, Mapping

import torch

from common.errors import CheckpointError, ConfigError, InteropError
from model.config import ModelConfig, RopeScaling
from model.gpt import GPT
from model.interop import CONFIG_FILE, check_state_dict, read_hf_dir, read_nanogpt_ckpt, write_hf_dir
from parallel.checkpoint import FULL_STATE_FILE, has_sharded_state, read_model_weights, safe_torch_load
from parallel.zero import CHECKPOINT_TAG, read_zero_model_weights
from training import checkpoint as ckpt
from training.config import JobConfig, from_dict, to_dict, upgrade_renamed

FORMATS = ("hf", "safetensors")
# What a source defines: the function its weights compute (shapes, norms, positions, heads, attention
# windows and sinks, biases, which experts a token runs and how their outputs are weighed). The other
# model keys (dropout, backends, recompute, init, the MoE balancing losses, routing bias rate and
# capacity) stay the run's.
ARCHITECTURE_KEYS = ("vocab_size", "max_seq_len", "n_layer", "n_head", "n_kv_head", "d_model", "attention_head_dim",
                     "qk_norm", "d_ff", "norm", "norm_eps", "mlp", "gelu", "swiglu_limit", "swiglu_alpha", "position",
                     "rope_theta", *(f"rope_scaling.{k}" for k in RopeScaling.__dataclass_fields__), "tie_embeddings",
                     "bias", "qkv_bias", "proj_bias", "sliding_window", "sliding_window_every", "sliding_window_first",
                     "attention_sinks", "moe.experts", "moe.top_k", "moe.shared_experts", "moe.d_ff", "moe.every",
                     "moe.first_dense", "moe.router", "moe.renormalize", "moe.routed_scale", "moe.bias", "mup",
                     "mup_base_width", "attention_kind", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "mtp_depth", "moe.groups", "moe.groups_kept", "moe.score_bias")
# Keys whose unset value means a derived one: a config and a source agree when the derived values do.
DERIVED = {"n_kv_head": "kv_heads", "attention_head_dim": "head_dim", "moe.d_ff": "expert_d_ff",
           "qkv_bias": "has_qkv_bias", "proj_bias": "has_proj_bias"}
SAFETENSORS_NAME = "model.safetensors"
EXPORT_FILES = frozenset({CONFIG_FILE, SAFETENSORS_NAME})  # what either format writes into --out
# Keys of the safetensors metadata (strings only) and of an exported HF config.json.
META_MODEL, META_TOKENIZER, META_EOT = "perfgpt_model", "perfgpt_tokenizer", "perfgpt_eot_id"
# Prefixes wrappers put before parameter names (torch.compile, DDP, activation checkpointing).
WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_checkpoint_wrapped_module.")


@dataclass
class ModelSource:
    cfg: ModelConfig
    state: dict[str, torch.Tensor]
    tokenizer: str | None  # data.tokenizer.build_tokenizer spec; None: unknown (pass --tokenizer)
    eot_id: int | None
    origin: str  # one line for the log: what was read
    warnings: list[str] = field(default_factory=list)  # what the reader should hear (e.g. a damaged checkpoint passed over)

    def build(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> GPT:
        """The GPT with these weights, in eval mode."""
        model = GPT(self.cfg)
        model.load_state_dict(self.state)
        model.to(device=device, dtype=dtype)
        return model.eval()


def load_source(path: str | Path) -> ModelSource:
    """Any supported source (see the module docstring), its weights checked against its config."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist (expected a checkpoint or run directory, an exported "
                              ".safetensors file, a Hugging Face model directory or a nanoGPT ckpt.pt)")
    if path.is_file() and path.suffix == ".safetensors":
        source = _read_safetensors(path)
    elif path.is_file():
        cfg, state = read_nanogpt_ckpt(path)
        source = ModelSource(cfg, state, *_nanogpt_tokenizer(cfg), origin=f"nanoGPT checkpoint {path}")
    elif (path / CONFIG_FILE).is_file():
        source = _read_hf(path)
    elif (path / SAFETENSORS_NAME).is_file():
        source = _read_safetensors(path / SAFETENSORS_NAME)
    else:
        warnings: list[str] = []
        step_dir, verified = _step_dir(path, warnings.append)
        source = read_checkpoint(step_dir, warnings.append, verify=not verified)
        source.warnings = list(dict.fromkeys(warnings))  # the "no checksums" note once
    check_state_dict(source.cfg, source.state)
    return source


def with_initial_weights(cfg: JobConfig, explicit: Collection[str] = ()) -> tuple[JobConfig, ModelSource, str]:
    """``cfg`` with the architecture of ``model.init_from`` (every ``ARCHITECTURE_KEYS`` key the
    source defines), those weights, and a log line naming the source and every key it changed.

    ``explicit``: the dotted keys the config file and the overrides set (``explicit_keys``). Where
    one of them asks for another value than the source's, the run would not be the source's model:
    a one-line ConfigError names each such key with both values. Keys left at their defaults are
    the source's. One exception: with rotary positions no weight depends on ``max_seq_len``, so an
    explicit one stays the run's context length.
    """
    source = load_source(cfg.model.init_from)
    ours, theirs = cfg.model, source.cfg
    keys = [k for k in ARCHITECTURE_KEYS if not (k == "max_seq_len" and theirs.position == "rope"
                                                 and f"model.{k}" in explicit)]
    differ = [k for k in keys if _effective(ours, k) != _effective(theirs, k)]
    conflicts = [k for k in differ if f"model.{k}" in explicit]
    if conflicts:
        listed = ", ".join(f"model.{k}={_effective(ours, k)} (the source's: {_effective(theirs, k)})" for k in conflicts)
        raise ConfigError(f"model.init_from={cfg.model.init_from} defines the model's architecture, and the config "
                          f"sets {listed}; set {'them' if len(conflicts) > 1 else 'it'} to the source's value or leave "
                          f"{'them' if len(conflicts) > 1 else 'it'} out of the config")
    changed = [f"{k} {_effective(ours, k)} -> {_effective(theirs, k)}" for k in differ]
    cfg = replace(cfg, model=ours.with_values({k: theirs.value_of(k) for k in keys}))
    cfg.validate()  # e.g. tensor parallelism must still divide the heads of the imported model
    note = (f"model.init_from: {source.origin}; architecture from it"
            + (f" ({', '.join(changed)})" if changed else " (the same as configured)"))
    note = "\n".join([f"model.init_from: warning: {w}" for w in source.warnings] + [note])
    return cfg, source, note


def _effective(cfg: ModelConfig, key: str) -> Any:
    return getattr(cfg, DERIVED[key]) if key in DERIVED else cfg.value_of(key)


def read_checkpoint(step_dir: Path, warn: ckpt.Warn | None = None, *, verify: bool = True) -> ModelSource:
    """The model of one perfgpt checkpoint directory, whichever layout saved it, once its files'
    contents match their checksums (a damaged one is a one-line CheckpointError naming the file;
    ``verify=False``: the caller has just checked them)."""
    meta = ckpt.read_checkpoint_meta(step_dir, 1, "", reshard=True)
    damage = ckpt.verify_contents(step_dir, warn) if verify else None
    if damage is not None:
        raise CheckpointError(f"{damage}; use another checkpoint (a run directory gives its newest intact one)")
    if "model" not in meta:
        raise CheckpointError(f"{step_dir / ckpt.META} records no model config; it was written by an older perfgpt")
    cfg = model_config(meta["model"], f"{step_dir / ckpt.META}")
    if has_sharded_state(step_dir):
        state, kind = read_model_weights(step_dir), "sharded (DCP)"
    elif (step_dir / CHECKPOINT_TAG).is_dir():
        state, kind = read_zero_model_weights(step_dir), "DeepSpeed ZeRO"
    elif (step_dir / FULL_STATE_FILE).is_file():
        state, kind = safe_torch_load(step_dir / FULL_STATE_FILE, map_location="cpu")["model"], "full-state"
    else:
        raise CheckpointError(f"{step_dir} holds no model weights (no {FULL_STATE_FILE}, dcp/ or {CHECKPOINT_TAG}/)")
    state = _plain_names(state)
    if cfg.tie_embeddings and "lm_head.weight" not in state and "tok_emb.weight" in state:
        state["lm_head.weight"] = state["tok_emb.weight"]  # one tensor, saved once by some engines
    layout = meta.get("layout") or {}
    words = " ".join(f"{k}={v}" for k, v in layout.items() if v != 1) or "one replica"
    origin = (f"perfgpt checkpoint {step_dir} (step {meta.get('step')}, {kind}, strategy "
              f"{meta.get('strategy')}, {words}, {meta.get('world_size')} rank(s))")
    return ModelSource(cfg, state, meta.get("tokenizer") or None, meta.get("eot_id"), origin)


def model_config(raw: Mapping[str, Any], where: str) -> ModelConfig:
    """The model config a checkpoint or an export recorded; keys renamed since it was written
    (``ModelConfig.renamed_keys``) are read under their new names."""
    try:
        return from_dict(ModelConfig, upgrade_renamed(ModelConfig, raw), "model.")
    except Exception as exc:  # noqa: BLE001 -- a config this code cannot build, whatever the reason
        raise CheckpointError(f"{where}: its model config does not build here: {exc}") from None


def _step_dir(path: Path, warn: ckpt.Warn) -> tuple[Path, bool]:
    """A checkpoint directory from a step, checkpoint-root or run directory, and whether its
    contents were verified: of a root or run, the newest complete and intact checkpoint, and
    ``warn`` hears about each newer one passed over."""
    if (path / ckpt.META).is_file():
        return path, False
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    found, skipped = ckpt.scan_checkpoints(root, warn, lambda p: ckpt.verify_contents(p, warn), who=f"reading {path}")
    if found is None and skipped:
        raise CheckpointError(f"{path} holds no complete and intact checkpoint: {'; '.join(skipped)}")
    if found is None:
        raise CheckpointError(f"{path} holds no complete perfgpt checkpoint, Hugging Face config.json or "
                              f"{SAFETENSORS_NAME}")
    return found, True


def _plain_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        for prefix in WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        out[name] = tensor.detach().to("cpu")
    return out


def _nanogpt_tokenizer(cfg: ModelConfig) -> tuple[str | None, int | None]:
    # nanoGPT trains on GPT-2's BPE (50257 ids, padded to 50304); its char-level example has its own.
    return ("tiktoken:gpt2", 50256) if cfg.vocab_size >= 50257 else (None, None)


def _read_hf(path: Path) -> ModelSource:
    cfg, state = read_hf_dir(path)
    config = json.loads((path / CONFIG_FILE).read_text())
    tokenizer = config.get(META_TOKENIZER)
    if tokenizer is None and (path / "tokenizer.json").is_file():
        tokenizer = f"hf:{path / 'tokenizer.json'}"
    eos = config.get("eos_token_id")
    eot = eos[0] if isinstance(eos, list) and eos else eos
    return ModelSource(cfg, state, tokenizer, eot, origin=f"Hugging Face {config.get('model_type')} model {path}")


def _read_safetensors(file: Path) -> ModelSource:
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(file), framework="pt") as handle:
            meta = handle.metadata() or {}
        state = load_file(str(file))
    except Exception as exc:  # noqa: BLE001 -- safetensors raises its own error types for damaged files
        raise InteropError(f"cannot read {file}: {str(exc).splitlines()[0][:200] if str(exc) else exc}") from None
    if META_MODEL not in meta:
        raise InteropError(f"{file} has no {META_MODEL} metadata: not written by tools/export.py "
                           "(for a Hugging Face model pass its directory)")
    cfg = model_config(json.loads(meta[META_MODEL]), str(file))
    if cfg.tie_embeddings and "tok_emb.weight" in state:
        state["lm_head.weight"] = state["tok_emb.weight"]  # stored once
    eot = meta.get(META_EOT)
    return ModelSource(cfg, state, meta.get(META_TOKENIZER) or None, int(eot) if eot not in (None, "") else None,
                       origin=f"perfgpt export {file}")


def write_export(source: ModelSource, out: str | Path, fmt: str, dtype: torch.dtype | None = None, *,
                 overwrite: bool = False) -> Path:
    """``out`` becomes a Hugging Face directory (fmt hf) or holds ``model.safetensors`` (fmt
    safetensors); returns the file or directory written.

    ``out`` must be new or empty; with ``overwrite`` it may hold an earlier export, which is
    replaced. A directory with other files (another model's tokenizer, generation config, ...) is
    refused either way: replacing only some of its files would leave a model that is neither.
    """
    if fmt not in FORMATS:
        raise InteropError(f"unknown export format {fmt!r}; valid: {', '.join(FORMATS)}")
    _check_export_dir(Path(out), overwrite)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in source.state.items()}
    out = Path(out)
    if fmt == "hf":
        extra: dict[str, Any] = {}
        if source.eot_id is not None:
            extra.update(eos_token_id=source.eot_id, bos_token_id=source.eot_id)
        if source.tokenizer:
            extra[META_TOKENIZER] = source.tokenizer
        return write_hf_dir(source.cfg, state, out, extra)
    return _write_safetensors(source, state, out / SAFETENSORS_NAME)


def _check_export_dir(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise InteropError(f"--out {out} is a file; give a directory (new or empty)")
    existing = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    foreign = [name for name in existing if name not in EXPORT_FILES and not name.endswith(".tmp")]
    if foreign:
        raise InteropError(f"--out {out} is not empty and holds {foreign[0]}, which an export does not write; "
                           "choose a new or empty directory")
    if existing and not overwrite:
        raise InteropError(f"--out {out} already holds an export ({', '.join(existing)}); pass --overwrite to "
                           "replace it, or choose another --out")


def _write_safetensors(source: ModelSource, state: Mapping[str, torch.Tensor], file: Path) -> Path:
    from safetensors.torch import save_file

    tensors = {k: v for k, v in state.items() if not (source.cfg.tie_embeddings and k == "lm_head.weight")}
    meta = {"format": "pt", META_MODEL: json.dumps(to_dict(source.cfg)), META_TOKENIZER: source.tokenizer or "",
            META_EOT: "" if source.eot_id is None else str(source.eot_id)}
    tmp = file.with_name(file.name + ".tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        tmp.replace(file)  # a failed write never leaves an earlier export half-overwritten
    except OSError as exc:
        raise InteropError(f"cannot write {file}: {exc.strerror or exc} (errno {exc.errno})") from None
    return file
