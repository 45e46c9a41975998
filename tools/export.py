"""Export a trained model: any perfgpt checkpoint (or another source) to safetensors or a Hugging Face directory.

    python -m tools.export runs/tiny --format hf --out exported/tiny            # the run's newest checkpoint
    python -m tools.export runs/tiny/checkpoints/step_00000600 --format safetensors --out exported/tiny-st
    python -m tools.export path/to/nanogpt/ckpt.pt --format hf --out exported/nanogpt --dtype bf16

The checkpoint may come from any layout (one process, DDP, FSDP2, ZeRO-1/2/3, tp/pp): it is
consolidated in this one process, on the CPU. ``--format hf`` writes ``config.json`` and
``model.safetensors`` that ``transformers.AutoModelForCausalLM.from_pretrained`` loads (GPT-2
layout for learned positions + LayerNorm + GELU, Llama layout for RoPE + RMSNorm + SwiGLU, Mixtral
or Qwen3-MoE layout for a mixture of experts; other combinations are refused naming the key); ``--format safetensors`` writes perfgpt's own names
with the model config and the tokenizer in the file's metadata, which tools/sample.py,
tools/evaluate.py and ``--model.init_from`` read back.
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import sys
from pathlib import Path

import torch

from common.errors import USER_FACING_ERRORS
from training.model_io import FORMATS, load_source, write_export

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="checkpoint, checkpoint root or run directory; or an exported "
                        ".safetensors file, a Hugging Face directory or a nanoGPT ckpt.pt")
    parser.add_argument("--format", required=True, choices=FORMATS, help="hf: a Hugging Face model directory; "
                        "safetensors: one file of perfgpt's own weights")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast floating-point weights (default: as saved)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out (a directory "
                        "holding anything else is refused either way)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        source = load_source(args.source)
        for line in source.warnings:
            print(f"warning: {line}", file=sys.stderr)
        written = write_export(source, args.out, args.format, DTYPES.get(args.dtype), overwrite=args.overwrite)
    except USER_FACING_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n_params = sum(t.numel() for name, t in source.state.items()
                   if not (source.cfg.tie_embeddings and name == "lm_head.weight"))
    print(f"read {source.origin}: {n_params:,} parameters; tokenizer {source.tokenizer or 'unknown'}")
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
