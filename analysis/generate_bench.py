"""Generation speed against transformers' ``generate`` on the same model and weights.

perfgpt's ``model.generate.generate`` and transformers' ``generate`` (the model built from
``model/interop.py``'s config and weights, SDPA attention, its own KV cache) decode the same batch
of prompts greedily for the same number of new tokens, one after the other in interleaved rounds.
Prompts of unequal lengths are what lm-eval's batched requests look like; transformers takes them
padded on the left with an attention mask, as lm-eval's own Hugging Face backend hands them over.
The two outputs must be the same tokens (checked on every call, so a faster wrong answer cannot
pass). Reported: time per batch of each and the per-round ratio (median, min, max).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.errors import CapabilityError
from common.measure import RatioSummary, Summary, interleaved, ratio_summary, summarize
from model.config import ModelConfig
from model.generate import generate
from model.gpt import GPT
from model.interop import to_hf_config, to_hf_state_dict


@dataclass(frozen=True)
class GenerateResult:
    perfgpt: Summary
    transformers: Summary
    perfgpt_vs_transformers: RatioSummary  # time ratio: below 1 is faster


def transformers_twin(cfg: ModelConfig, model: GPT) -> torch.nn.Module:
    try:
        import transformers
    except ImportError:
        raise CapabilityError("bench_generate needs transformers (in the dev extra): pip install -e '.[dev]'") from None
    hf_config = transformers.AutoConfig.for_model(**to_hf_config(cfg, {"use_cache": True}))
    twin = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
    missing, unexpected = twin.load_state_dict(to_hf_state_dict(cfg, model.state_dict()), strict=False)
    if set(missing) - ({"lm_head.weight"} if cfg.tie_embeddings else set()) or unexpected:
        raise RuntimeError(f"perfgpt's weights do not fill transformers' model: missing {missing}, extra {unexpected}")
    twin.tie_weights()
    return twin.eval()


def run_generate_benchmark(cfg: ModelConfig, *, prompt_lens: list[int], new_tokens: int, rounds: int,
                           seed: int = 0) -> GenerateResult:
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    twin = transformers_twin(cfg, model)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in prompt_lens]
    longest = max(prompt_lens)
    padded = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(padded)
    for row, prompt in enumerate(prompts):
        padded[row, longest - len(prompt):] = torch.tensor(prompt)
        mask[row, longest - len(prompt):] = 1
    outputs: dict[str, list[list[int]]] = {}

    def ours() -> None:
        outputs["perfgpt"] = generate(model, prompts, new_tokens)

    def theirs() -> None:
        with torch.no_grad():
            out = twin.generate(padded, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, pad_token_id=0)
        outputs["transformers"] = out[:, longest:].tolist()
        if outputs.get("perfgpt") is not None and outputs["perfgpt"] != outputs["transformers"]:
            raise RuntimeError("perfgpt and transformers decoded different tokens from the same weights")

    samples = interleaved({"perfgpt": ours, "transformers": theirs}, rounds, warmup=1, progress="generate")
    return GenerateResult(summarize(samples["perfgpt"]), summarize(samples["transformers"]),
                          ratio_summary(samples["perfgpt"], samples["transformers"]))
