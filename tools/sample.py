"""Generate text from a trained model, with a KV cache.

    python -m tools.sample runs/tiny --prompt "def " --max-new-tokens 64
    python -m tools.sample exported/tiny --prompt "import " --prompt "class " --temperature 0.8 --top-k 40 --seed 1
    python -m tools.sample runs/tiny --prompt "def " --greedy --max-new-tokens 32

SOURCE is anything tools/export.py reads: a checkpoint (any layout), a checkpoint root or run
directory, an exported .safetensors file, a Hugging Face directory or a nanoGPT ckpt.pt. The
tokenizer is the one the run's dataset was prepared with (recorded in the checkpoint and carried
into exports); ``--tokenizer`` overrides it. Several ``--prompt`` run as one batch. Generation
stops at ``--max-new-tokens`` or at the end-of-text token (``--no-stop`` keeps going).
"""

from __future__ import annotations

if not __package__:  # started as a file, where the project's packages do not import: say how to run it
    from _run_as_module import exit_with_usage

    exit_with_usage(__file__)

import argparse
import sys
from pathlib import Path

import torch

from common.errors import USER_FACING_ERRORS, ConfigError
from data.tokenizer import build_model_tokenizer
from model.generate import Sampling, generate
from training.model_io import load_source


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path)
    parser.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--greedy", action="store_true", help="argmax decoding (same as --temperature 0)")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-stop", action="store_true", help="do not stop at the end-of-text token")
    parser.add_argument("--no-cache", action="store_true", help="re-run the whole prefix every step (slow; a check)")
    parser.add_argument("--tokenizer", help="byte | tiktoken:<encoding> | hf:<tokenizer.json> (default: the source's)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    return parser.parse_args(argv)


def sample(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(prompt, continuation text, new tokens) per prompt."""
    source = load_source(args.source)
    for line in source.warnings:
        print(f"warning: {line}", file=sys.stderr)
    spec = args.tokenizer or source.tokenizer
    if not spec:
        raise ConfigError(f"{args.source} does not record its tokenizer; pass --tokenizer (byte, tiktoken:<encoding> "
                          "or hf:<tokenizer.json>)")
    tokenizer = build_model_tokenizer(spec, source.cfg.vocab_size, "pass the run's own --tokenizer")
    prompts = [tokenizer.encode(_prompt_text(p, i)).tolist() for i, p in enumerate(args.prompt, 1)]
    model = source.build(torch.device(args.device))
    sampling = Sampling(temperature=0.0 if args.greedy else args.temperature, top_k=args.top_k, top_p=args.top_p,
                        seed=args.seed)
    eos = None if args.no_stop else source.eot_id
    outputs = generate(model, prompts, args.max_new_tokens, sampling, eos_id=eos, use_cache=not args.no_cache)
    results = []
    for prompt, out in zip(args.prompt, outputs):
        new = [t for t in out if t != eos]
        results.append((prompt, tokenizer.decode(new), len(new)))
    return results


def _prompt_text(prompt: str, index: int) -> str:
    """The prompt as text; the shell hands non-UTF-8 bytes over as lone surrogates, which no
    tokenizer can encode."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raw = prompt.encode("utf-8", "surrogateescape")
        raise ConfigError(f"--prompt #{index} is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at position "
                          f"{exc.start}); pass the prompt as UTF-8 text") from None
    return prompt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        results = sample(args)
    except USER_FACING_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The prompt in the header, the continuation on its own lines: printed back to back, the two
    # join without a visible seam (a byte tokenizer) or glued words (a word-level one).
    for prompt, text, n in results:
        print(f"--- {prompt!r} + {n} new token{'s' if n != 1 else ''}:\n{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
