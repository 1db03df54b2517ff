"""Checkpoint formats in one process: Hugging Face export (transformers logits == native logits, export ->
import bit-identical), the recorded method, and clear errors for missing / truncated / corrupt files."""
import json
import shutil

import pytest
import torch

VARIANTS = {
    "gelu": dict(activation="gelu"),
    "swiglu_gqa_bias": dict(activation="swiglu", num_query_groups=2, add_bias_linear=True, rotary_percent=0.5),
    "tied_rmsnorm": dict(tie_embeddings=True, normalization="RMSNorm"),
    # the families' features (issue 30): Qwen3 (head size != hidden / heads, q / k norms, float RoPE base),
    # Qwen2 + Llama 3 (q / k / v bias only, RoPE scaling, tied, eps), the reference DiT (bias-free LayerNorm,
    # MLP bias without attention bias, GELU-tanh)
    "qwen3": dict(activation="swiglu", normalization="RMSNorm", num_query_groups=2, kv_channels=12,
                  qk_layernorm=True, rotary_base=1000000.0, norm_eps=1e-6, head_bias=False),
    "qwen2_llama3": dict(activation="swiglu", normalization="RMSNorm", num_query_groups=1, add_qkv_bias=True,
                         rope_scaling="llama3", rope_scaling_factor=4.0, rope_original_max_positions=4,
                         rotary_base=500000.0, tie_embeddings=True, head_bias=False, norm_eps=1e-6),
    "dit": dict(activation="gelu_tanh", norm_bias=False, mlp_bias=True, head_bias=True),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from setdiff_mega.data.prepare import prepare
    from setdiff_mega.data.tokenizer import Tokenizer

    out = tmp_path_factory.mktemp("tok")
    prepare(out, None, num_math=60, num_stories=60, vocab_size=300, heldout=2, log=lambda *a: None)
    return Tokenizer.from_file(out / "tokenizer.json")


def _checkpoint(tmp_path, tokenizer, variant, objective="setdlm"):
    from setdiff_mega.checkpoint import save_model_checkpoint
    from setdiff_mega.config import load_config
    from setdiff_mega.model import build_model

    over = [f"model.{k}={v}" for k, v in {**VARIANTS[variant], "num_layers": 2, "hidden_size": 32,
                                           "num_attention_heads": 4, "zero_init_head": False}.items()]
    cfg = load_config(None, over + [f"objective.name={objective}", "objective.D=2", "data.seq_length=16"])
    torch.manual_seed(3)
    model = build_model(cfg.model, tokenizer.vocab_size)
    with torch.no_grad():                       # non-trivial biases and norms (zero / one at init)
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return save_model_checkpoint(tmp_path / "native", 7, model, cfg, tokenizer), model.eval(), cfg


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_export_matches_native_logits_and_converts_back_bit_identically(mcore, tmp_path, tokenizer, variant):
    from transformers import AutoModel

    from setdiff_mega.checkpoint import convert, full_state_dict
    from setdiff_mega.diffusion import build_objective
    from setdiff_mega.hfmodel.generation_setdlm import DecodeModel

    ck, model, cfg = _checkpoint(tmp_path, tokenizer, variant)
    out = convert.export(ck, tmp_path / "hf")
    hf_model = AutoModel.from_pretrained(str(out), trust_remote_code=True).eval()
    objective = build_objective("setdlm", tokenizer.mask, D=2)
    tokens = torch.randint(0, tokenizer.vocab_size - 4, (3, 16), generator=torch.Generator().manual_seed(0))
    inp = objective.build_inputs(tokens, generator=torch.Generator().manual_seed(1))   # the 2L set-causal layout
    with torch.no_grad():
        native = model(inp.tokens, inp.position_ids, inp.attention_mask, inp.logits_start)
        exported = hf_model(inp.tokens, position_ids=inp.position_ids, attention_mask=inp.attention_mask,
                            logits_start=inp.logits_start).logits
    assert exported.shape == native.shape == (3, 16, tokenizer.vocab_size)
    torch.testing.assert_close(exported, native, rtol=1e-5, atol=1e-5)
    with torch.no_grad():                       # the third forward: the fused decode step over the same weights
        stepped = DecodeModel(hf_model)(inp.tokens, inp.position_ids, inp.attention_mask, inp.logits_start)
    torch.testing.assert_close(stepped, native, rtol=1e-5, atol=1e-5)

    back = convert.import_export(out, tmp_path / "back")
    assert back.name == "step_0000007"
    original, reimported = full_state_dict(ck), full_state_dict(back)
    assert set(original) == set(reimported)
    for k, v in original.items():
        assert torch.equal(v, reimported[k]), k


def test_export_records_the_method_and_tokenizer(mcore, tmp_path, tokenizer):
    from transformers import AutoTokenizer

    from setdiff_mega.checkpoint import convert, load_model

    ck, model, cfg = _checkpoint(tmp_path, tokenizer, "gelu")
    out = convert.export(ck, tmp_path / "hf")
    meta = json.loads((out / "config.json").read_text())
    assert meta["method"]["objective"] == "setdlm" and meta["method"]["D"] == 2 and meta["method"]["S_max"] == 4
    assert meta["method"]["mask_token_id"] == tokenizer.mask == meta["mask_token_id"]
    assert meta["auto_map"]["AutoModel"] == "modeling_setdlm.SetDLMForDiffusionLM"
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    text = "Tom has 3 apples. #### 3"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    assert hf_tok.mask_token_id == tokenizer.mask
    # the sampler side rebuilds itself from the directory alone
    m2, objective, tok2, cfg2 = load_model(out)
    assert objective.name == "setdlm" and objective.D == 2 and tok2.hash == tokenizer.hash
    ids = torch.tensor([[tokenizer.bos, 5, 6, 7]])
    pos = torch.arange(4)[None]
    with torch.no_grad():
        torch.testing.assert_close(m2(ids, pos, None), model(ids, pos, None), rtol=0, atol=0)


def test_default_masks_of_the_exported_model(mcore, tmp_path, tokenizer):
    """Without a mask: causal for an AR model, bidirectional otherwise; a [B, T] padding mask hides keys."""
    from transformers import AutoModel

    from setdiff_mega.checkpoint import convert

    ck, model, _ = _checkpoint(tmp_path, tokenizer, "gelu", objective="ar")
    hf_model = AutoModel.from_pretrained(str(convert.export(ck, tmp_path / "hf")), trust_remote_code=True).eval()
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(9).expand(2, 9)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, model(ids, pos, causal), rtol=1e-5, atol=1e-5)
        pad = torch.ones(2, 9, dtype=torch.long)
        pad[1, 6:] = 0
        a = hf_model(ids, attention_mask=pad).logits
        torch.testing.assert_close(a[1, :6], hf_model(ids[1:, :6]).logits[0], rtol=1e-5, atol=1e-5)


def test_missing_truncated_and_corrupt_checkpoints_name_the_file(mcore, tmp_path, tokenizer):
    from setdiff_mega.checkpoint import CheckpointError, convert, load_model

    ck, _, _ = _checkpoint(tmp_path, tokenizer, "gelu")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    # an interrupted save (only a .tmp directory) is not a checkpoint
    partial = tmp_path / "partial" / "checkpoints" / "step_0000003.tmp"
    shutil.copytree(ck, partial)
    (partial / "state.json").unlink()
    with pytest.raises(CheckpointError, match="no complete checkpoint at .*interrupted saves"):
        load_model(tmp_path / "partial")
    # a shard truncated after the save
    shard = next((ck / "dist").glob("*.distcp"))
    size = shard.stat().st_size
    data = shard.read_bytes()
    shard.write_bytes(data[: size // 2])
    with pytest.raises(CheckpointError, match=rf"'{shard}' is truncated or modified: {size // 2} bytes, {size} when"):
        load_model(ck)
    shard.write_bytes(data)
    # a corrupt state.json
    state = (ck / "state.json").read_text()
    (ck / "state.json").write_text(state[:20])
    with pytest.raises(CheckpointError, match=rf"'{ck / 'state.json'}' is corrupt"):
        load_model(ck)
    (ck / "state.json").write_text(state)
    load_model(ck)                                                        # restored: loads again

    out = convert.export(ck, tmp_path / "hf")
    st = out / "model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=rf"'{st}' is truncated or unreadable"):
        load_model(out)
    st.unlink()
    with pytest.raises(CheckpointError, match=rf"'{st}' is missing"):
        load_model(out)


def test_exported_weights_of_another_shape_name_the_tensor(mcore, tmp_path, tokenizer):
    from safetensors.torch import load_file, save_file

    from setdiff_mega.checkpoint import CheckpointError, convert, load_model

    ck, _, _ = _checkpoint(tmp_path, tokenizer, "gelu")
    out = convert.export(ck, tmp_path / "hf")
    w = load_file(str(out / "model.safetensors"))
    w["model.layers.1.mlp.up_proj.weight"] = torch.zeros(64, 32)
    save_file(w, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.1.mlp.up_proj.weight' has shape \(64, 32\), "
                                              r"the config's architecture needs \(128, 32\)"):
        load_model(out)
