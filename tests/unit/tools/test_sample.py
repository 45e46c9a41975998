"""tools/sample.py's output: where the prompt ends and the continuation begins."""

from __future__ import annotations

import torch
import transformers

from model.config import ModelConfig
from model.gpt import GPT
from tools import sample as sample_tool
from training.model_io import ModelSource, write_export


def test_the_continuation_is_printed_apart_from_the_prompt_with_a_word_level_tokenizer(tmp_path, capsys):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(254)} | {"[UNK]": 254, "<|endoftext|>": 255}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.decoder = decoders.WordPiece()  # joins the words with spaces
    words.save(str(tmp_path / "words.json"))
    cfg = ModelConfig(vocab_size=256, max_seq_len=32, n_layer=1, n_head=2, d_model=32)
    torch.manual_seed(0)
    source = write_export(ModelSource(cfg, GPT(cfg).state_dict(), f"hf:{tmp_path / 'words.json'}", None, "test"),
                          tmp_path / "hf", "hf")
    prompt = "t250 t7"
    assert sample_tool.main([str(source), "--prompt", prompt, "--greedy", "--no-stop", "--max-new-tokens", "5"]) == 0
    printed = capsys.readouterr().out
    # the reference continuation: transformers' own greedy decoding of the exported model
    hf = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    ids = torch.tensor([[250, 7]])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=5, min_new_tokens=5,
                      pad_token_id=0)
    continuation = words.decode(out[0, 2:].tolist())
    assert printed == f"--- {prompt!r} + 5 new tokens:\n{continuation}\n", printed
