"""Multi-token prediction under the document mask, and what stays refused with it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.errors import ConfigError
from model.config import ModelConfig
from model.gpt import GPT
from tests.unit.model.test_deepseek import mla_model, mtp_reference
from tests.unit.model.test_interop import VOCAB


@pytest.mark.parametrize("attention", ["sdpa", "reference"])
def test_mtp_under_the_document_mask_equals_each_document_alone(attention):
    """Packed documents: the main loss and every depth's MTP loss equal those of each document run
    alone (positions from 0, the written-out reference), summed over the documents: no depth reads a
    token or predicts a target of another document, and no position attends across one."""
    torch.manual_seed(0)
    cfg = mla_model(mtp_depth=2, attention_kind="gqa", attention_mask="document", document_positions=True)
    packed = GPT(cfg, attention_backend=attention).train()
    alone = GPT(dataclasses.replace(cfg, attention_mask="causal"), attention_backend=attention).train()
    alone.load_state_dict(packed.state_dict())
    lengths = [(4, 7, 6), (3, 9, 5)]  # documents of each row, each ending with the end-of-text id 0
    rows = []
    for row in lengths:
        docs = [torch.cat([torch.randint(1, VOCAB, (n - 1,)), torch.zeros(1, dtype=torch.long)]) for n in row]
        rows.append(torch.cat(docs + [torch.randint(1, VOCAB, (1,))]))  # the last target
    seq = torch.stack(rows)
    main = packed(seq[:, :-1], seq[:, 1:])
    got = packed.take_mtp_loss()
    sums, counts = torch.zeros(3), torch.zeros(3)  # main, depth 1, depth 2
    with torch.no_grad():
        for b, row in enumerate(lengths):
            start = 0
            for n in row:
                ref_main, ref_depths = mtp_reference(alone, seq[b:b + 1, start:start + n + 1])
                for d, (loss, count) in enumerate(zip([ref_main, *ref_depths], [n, n - 1, n - 2])):
                    sums[d] += loss * count
                    counts[d] += count
                start += n
    expected = sums / counts
    torch.testing.assert_close(main.detach(), expected[0])
    torch.testing.assert_close(got, expected[1:].mean())


def test_mtp_with_the_zero_bubble_schedule_is_refused_in_one_line():
    from training.config import load_config

    with pytest.raises(ConfigError, match="model.mtp_depth=1 with parallel.pp_schedule=zero_bubble is not supported")\
            as err:
        load_config(None, ["--model.mtp_depth=1", "--parallel.pp=2", "--parallel.pp_schedule=zero_bubble",
                           "--parallel.pp_virtual_stages=2", "--train.grad_accum_steps=2", "--model.n_layer=4"])
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------- DeepSeek-V3's published layout


def deepseek_with_mtp(depth: int, first_dense: int, seed: int = 0) -> GPT:
    """A small DeepSeek-shaped perfgpt model with ``depth`` MTP modules (their blocks MoE layers when
    their index n_layer + k >= ``first_dense``), every weight random (norm gains too)."""
    from model.config import MoEConfig

    torch.manual_seed(seed)
    cfg = mla_model(n_layer=2, mtp_depth=depth, q_lora_rank=24, d_ff=48, eot_id=None, moe=MoEConfig(
        experts=4, top_k=2, d_ff=16, shared_experts=1, router="sigmoid", score_bias=True, renormalize=True,
        routed_scale=2.5, groups=2, groups_kept=1, first_dense=first_dense))
    model = GPT(cfg, attention_backend="reference")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def test_mtp_modules_round_trip_through_deepseeks_published_layout_exactly(tmp_path):
    from model import interop

    model = deepseek_with_mtp(depth=2, first_dense=1)
    interop.write_hf_dir(model.cfg, model.state_dict(), tmp_path)
    written = interop.read_hf_weights(tmp_path)
    for k in range(2):  # module k is layer n_layer + k, with DeepSeek's names
        layer = f"model.layers.{2 + k}."
        for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens",
                     "self_attn.kv_a_proj_with_mqa", "mlp.gate", "mlp.experts.3.down_proj", "mlp.shared_experts.up_proj"):
            assert f"{layer}{name}.weight" in written, name
        c = model.cfg.d_model  # DeepSeek projects [embedding; hidden], perfgpt [hidden; embedding]
        proj = model.state_dict()[f"mtp.{k}.proj.weight"]
        assert torch.equal(written[f"{layer}eh_proj.weight"], torch.cat([proj[:, c:], proj[:, :c]], dim=1))
    cfg, state = interop.read_hf_dir(tmp_path)
    assert cfg == model.cfg and cfg.mtp_depth == 2
    assert state.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_a_deepseek_checkpoint_whose_mtp_copy_of_the_head_differs_is_refused(tmp_path):
    from safetensors.torch import save_file

    from common.errors import InteropError
    from model import interop

    model = deepseek_with_mtp(depth=1, first_dense=1)
    interop.write_hf_dir(model.cfg, model.state_dict(), tmp_path)
    weights = interop.read_hf_weights(tmp_path)
    weights["model.layers.2.shared_head.head.weight"] = weights["model.layers.2.shared_head.head.weight"] + 1
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(InteropError, match="'model.layers.2.shared_head.head.weight' differs from the model's lm_head"):
        interop.read_hf_dir(tmp_path)


def test_mtp_in_a_layout_without_modules_is_refused_in_one_line():
    from common.errors import InteropError
    from model import interop

    with pytest.raises(InteropError, match="model.mtp_depth=1: of the Hugging Face layouts only DeepSeek-V3") as err:
        interop.hf_layout(mla_model(attention_kind="gqa", mtp_depth=1))
    assert "\n" not in str(err.value)


def test_exported_mtp_weights_compute_transformers_mtp_layer_and_the_rest_its_logits(tmp_path):
    """Exported to DeepSeek's layout: DeepseekV3ForCausalLM gives the model's logits (and leaves the
    MTP layer out, as unexpected keys), and transformers' own MTP layer (``MtpLayer``, what its
    speculative decoding runs) on the exported weights gives the module's logits. Its block (an MoE
    layer) is loaded by transformers itself: the same directory read as a model one layer deeper."""
    import json
    import shutil

    transformers = pytest.importorskip("transformers")
    from transformers.modeling_layers import MtpLayer
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    from model import interop

    model = deepseek_with_mtp(depth=1, first_dense=1)
    interop.write_hf_dir(model.cfg, model.state_dict(), tmp_path / "out")

    def load(path):
        return transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32,
                                                                 attn_implementation="eager")

    hf, info = load(tmp_path / "out")
    hf.eval()
    assert hf.config.num_nextn_predict_layers == 1
    assert info["unexpected_keys"] and all(k.startswith("model.layers.2.") for k in info["unexpected_keys"])
    assert not info["missing_keys"]
    shutil.copytree(tmp_path / "out", tmp_path / "deeper")
    config = json.loads((tmp_path / "deeper" / "config.json").read_text())
    (tmp_path / "deeper" / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 3}))
    deeper, _ = load(tmp_path / "deeper")
    layer = MtpLayer(hf.config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, model.cfg.n_layer).eval()
    layer.mtp_block = deeper.model.layers[2].eval()
    written = interop.read_hf_weights(tmp_path / "out")
    layer.load_state_dict({ours: written[f"model.layers.2.{theirs}.weight"] for ours, theirs in (
        ("enorm.weight", "enorm"), ("hnorm.weight", "hnorm"), ("eh_proj.weight", "eh_proj"),
        ("post_norm.weight", "shared_head.norm"))}, strict=False)

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    last = {}
    hf.model.layers[-1].register_forward_hook(lambda m, args, out: last.update(h=out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=0)
        t = ids.shape[1] - 1
        position_ids = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        embeds = hf.model.embed_tokens(ids[:, 1:])
        out = layer(embeds, last["h"][:, :-1], hf.model.rotary_emb(embeds, position_ids), mask, position_ids, None)
        expected = hf.lm_head(out)
        h = model.tok_emb(ids)
        rope = (model.rope_cos, model.rope_sin)
        for block in model.blocks.values():
            h = block(h, rope)
        _, normed = model.mtp[0](h[:, :-1], model.tok_emb(ids[:, 1:]), rope)
        got = model.lm_head(normed)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_mtp_deeper_than_the_sequence_is_refused_in_one_line():
    # every target of such a depth would be past the sequence: its loss would be a mean over nothing
    with pytest.raises(ConfigError, match=r"model.mtp_depth=4 needs sequences longer than it \(model.max_seq_len=4\)"):
        ModelConfig(vocab_size=32, max_seq_len=4, n_layer=1, n_head=2, d_model=8, mtp_depth=4).validate()
