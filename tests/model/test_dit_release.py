"""The reference's DiT releases (setdlms / bd3lms layout: names and shapes as the reference writes them,
random values): the import gives the logits of a DiT forward written here from ``docs/method.md`` 4.2
(pre-LN blocks, bias-free LayerNorms, fused q;k;v over all heads, rotate-half RoPE, GELU-tanh MLP with
bias, untied head with bias), also with the legacy adaLN blocks folded in; the objective comes from the
release's noise config; export to that layout and back is bit-identical."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

V, D_MODEL, HEADS, LAYERS, L = 300, 32, 4, 2, 16
P = "backbone."


def _release(path, adaln: bool, seed=0):
    """A checkpoint in the official layout (pytorch_model.bin, as the reference's save_pretrained writes it)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, scale=0.2: scale * torch.randn(*shape, generator=g)  # noqa: E731
    sd = {P + "vocab_embed.embedding": r(V, D_MODEL, scale=1.0), P + "rotary_emb.inv_freq": torch.zeros(4),
          P + "output_layer.norm_final.weight": 1 + r(D_MODEL), P + "output_layer.linear.weight": r(V, D_MODEL),
          P + "output_layer.linear.bias": r(V), P + "static_attention_mask": torch.ones(2 * L, 2 * L, dtype=torch.bool)}
    for i in range(LAYERS):
        b = f"{P}blocks.{i}."
        sd.update({b + "norm1.weight": 1 + r(D_MODEL), b + "attn_qkv.weight": r(3 * D_MODEL, D_MODEL),
                   b + "attn_out.weight": r(D_MODEL, D_MODEL), b + "norm2.weight": 1 + r(D_MODEL),
                   b + "mlp.0.weight": r(4 * D_MODEL, D_MODEL), b + "mlp.0.bias": r(4 * D_MODEL),
                   b + "mlp.2.weight": r(D_MODEL, 4 * D_MODEL), b + "mlp.2.bias": r(D_MODEL)})
        if adaln:
            sd.update({b + "adaLN_modulation.weight": r(6 * D_MODEL, 8), b + "adaLN_modulation.bias": r(6 * D_MODEL)})
    if adaln:
        sd.update({P + "sigma_map.mlp.0.weight": r(8, 16), P + "sigma_map.mlp.0.bias": r(8),
                   P + "sigma_map.mlp.2.weight": r(8, 8), P + "sigma_map.mlp.2.bias": r(8),
                   P + "output_layer.adaLN_modulation.weight": r(2 * D_MODEL, 8),
                   P + "output_layer.adaLN_modulation.bias": r(2 * D_MODEL)})
    path.mkdir(parents=True, exist_ok=True)
    torch.save(sd, path / "pytorch_model.bin")
    config = {"model_type": "bd3lm", "architectures": ["BD3LM"], "length": L, "vocab_size": V,
              "mask_token_id": V - 1, "eos_token_id": 0, "bos_token_id": 0, "pad_token_id": 0,
              # the reference loader's warning: an exported max_block_size == length means 2D
              "noise_config": {"desired_block_size": 2, "max_block_size": L, "length": L},
              "backbone_config": {"n_heads": HEADS, "dropout": 0.1, "length": L, "adaln": adaln},
              "auto_map": {"AutoModel": "modeling_setdlm.SetDLM"}}
    (path / "config.json").write_text(json.dumps(config))
    _tokenizer(path)
    return sd


def _tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, V - 1)}}        # MASK (V - 1) is added on import
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(path / "tokenizer.json"))


def _layer_norm(x, w, shift=None, scale=None):
    y = F.layer_norm(x, (x.shape[-1],), w)
    return y if shift is None else y * (1 + scale) + shift


def _rope(x, pos):
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = pos.float()[..., None] * inv
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _dit_forward(sd, tokens, pos, keep, adaln):
    """method.md 4.2, eval mode (no dropout); adaLN with sigma = 0 (c = silu(sigma_map(0)))."""
    x = sd[P + "vocab_embed.embedding"][tokens]
    b, t, _ = x.shape
    c = None
    if adaln:
        freq = torch.cat([torch.ones(8), torch.zeros(8)])
        c = F.silu(F.linear(F.silu(F.linear(freq, sd[P + "sigma_map.mlp.0.weight"], sd[P + "sigma_map.mlp.0.bias"])),
                            sd[P + "sigma_map.mlp.2.weight"], sd[P + "sigma_map.mlp.2.bias"]))
    for i in range(LAYERS):
        blk = f"{P}blocks.{i}."
        mods = F.linear(c, sd[blk + "adaLN_modulation.weight"], sd[blk + "adaLN_modulation.bias"]).chunk(6) if adaln \
            else [None, None, 1.0, None, None, 1.0]
        h = _layer_norm(x, sd[blk + "norm1.weight"], mods[0], mods[1])
        qkv = F.linear(h, sd[blk + "attn_qkv.weight"]).view(b, t, 3, HEADS, D_MODEL // HEADS)
        q, k, v = (qkv[:, :, j].transpose(1, 2) for j in range(3))
        a = F.scaled_dot_product_attention(_rope(q, pos), _rope(k, pos), v, attn_mask=keep[:, None],
                                           scale=1 / math.sqrt(D_MODEL // HEADS))
        x = x + mods[2] * F.linear(a.transpose(1, 2).reshape(b, t, D_MODEL), sd[blk + "attn_out.weight"])
        h = _layer_norm(x, sd[blk + "norm2.weight"], mods[3], mods[4])
        m = F.gelu(F.linear(h, sd[blk + "mlp.0.weight"], sd[blk + "mlp.0.bias"]), approximate="tanh")
        x = x + mods[5] * F.linear(m, sd[blk + "mlp.2.weight"], sd[blk + "mlp.2.bias"])
    fin = F.linear(c, sd[P + "output_layer.adaLN_modulation.weight"],
                   sd[P + "output_layer.adaLN_modulation.bias"]).chunk(2) if adaln else (None, None)
    x = _layer_norm(x, sd[P + "output_layer.norm_final.weight"], *fin)
    return F.linear(x, sd[P + "output_layer.linear.weight"], sd[P + "output_layer.linear.bias"])


def _inputs():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (2, 12), generator=g)
    pos = torch.stack([torch.randperm(12, generator=g) for _ in range(2)])
    keep = (torch.rand(2, 12, 12, generator=g) < 0.6) | torch.eye(12, dtype=torch.bool)
    return tokens, pos, keep


@pytest.mark.parametrize("adaln", [False, True])
def test_a_dit_release_imports_with_the_reference_forward_and_its_method(mcore, tmp_path, adaln):
    from setdiff_mega.checkpoint import families

    sd = _release(tmp_path / "release", adaln)
    model, cfg, tok, adapter = families.load_family(tmp_path / "release")
    assert adapter.name == "dit" and cfg.model.norm_bias == adaln and cfg.model.hidden_dropout == 0.1
    assert (cfg.objective.name, cfg.objective.D, cfg.objective.S_max) == ("setdlm", 2, 4)   # not S_max = L
    assert tok.mask == V - 1 and tok.eos == 0
    tokens, pos, keep = _inputs()
    with torch.no_grad():
        ours = model(tokens, pos, keep)
        theirs = _dit_forward(sd, tokens, pos, keep, adaln)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # the trained MASK row is the release's, never replaced by a mean
    assert torch.equal(model.embedding.word_embeddings.weight[V - 1], sd[P + "vocab_embed.embedding"][V - 1])


def test_export_to_the_dit_layout_and_back_is_bit_identical(mcore, tmp_path):
    from safetensors.torch import load_file

    from setdiff_mega.checkpoint import families

    sd = _release(tmp_path / "release", adaln=False)
    ck = families.import_model(tmp_path / "release", tmp_path / "native")
    out = families.export_model(ck, tmp_path / "back")
    back = load_file(str(out / "model.safetensors"))
    kept = {k: v for k, v in sd.items() if "inv_freq" not in k and "static_attention_mask" not in k}
    assert set(back) == set(kept)
    for k, v in kept.items():
        assert torch.equal(back[k], v), k
    config = json.loads((out / "config.json").read_text())
    assert config["noise_config"]["desired_block_size"] == 2 and config["mask_token_id"] == V - 1
    again, cfg, _, _ = families.load_family(out)                   # and it reads back with its method
    assert (cfg.objective.name, cfg.objective.D, cfg.objective.S_max) == ("setdlm", 2, 4)


def test_a_folded_adaln_dit_is_not_exported_to_the_release_layout(mcore, tmp_path):
    """Its LayerNorms have biases (the folded shifts), which the release layout has no tensor for."""
    from setdiff_mega.checkpoint import CheckpointError, families

    _release(tmp_path / "release", adaln=True)
    ck = families.import_model(tmp_path / "release", tmp_path / "native")
    with pytest.raises(CheckpointError, match="LayerNorm biases .* export it with to-hf"):
        families.export_model(ck, tmp_path / "back")
    assert not (tmp_path / "back").exists()
