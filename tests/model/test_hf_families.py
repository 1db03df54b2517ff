"""Hugging Face families in and out, against transformers' own model classes (tiny random configs built
here): imported as AR, the megatron-core model gives transformers' logits (fp32, padded batch) and so does
the project's export of it; HF -> native -> HF (``--format hf``) is bit-identical; shards (safetensors
with an index, one file, pickled ``pytorch_model.bin`` with an index) are read lazily; MASK and bad input."""
import json

import pytest
import torch

V = 320
SPECIAL = {"llama": ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>"],
           "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_middle|>"]}
TEXT = ["the cat sat on the mat", "two plus two is four", "a story about a dog", "numbers 12 34 56"] * 20
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _tokenizer(path, kind):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=V - 20, special_tokens=SPECIAL[kind],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    tok.save(str(path / "tokenizer.json"))
    if kind == "llama":
        config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    else:
        config = {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                  "chat_template": TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


FAMILIES = {
    # GQA, head size != hidden / heads, attention and MLP biases, Llama 3 RoPE scaling, untied; sharded safetensors
    "llama": ("LlamaConfig", "LlamaForCausalLM", "llama",
              dict(head_dim=24, num_key_value_heads=2, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16}),
              "safetensors-sharded"),
    # q / k / v bias only, tied embeddings; pickled shards with an index
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "qwen", dict(num_key_value_heads=1, tie_word_embeddings=True,
                                                             rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 1e6}), "bin-sharded"),
    # q / k norms, head size 32 with hidden 64; one safetensors file
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen", dict(head_dim=32, num_key_value_heads=2,
                                                             tie_word_embeddings=False), "safetensors"),
}


def _save(model, path, how):
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if how == "safetensors-sharded":
        model.save_pretrained(str(path), max_shard_size="40KB")
        assert (path / "model.safetensors.index.json").is_file()
    elif how == "safetensors":
        model.save_pretrained(str(path), max_shard_size="50GB")
    else:
        names = sorted(state)
        half = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
                "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
        model.config.save_pretrained(str(path))
        for f, part in half.items():
            torch.save({k: state[k] for k in part}, path / f)
        index = {"metadata": {}, "weight_map": {k: f for f, part in half.items() for k in part}}
        (path / "pytorch_model.bin.index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    import transformers

    name = request.param
    config_cls, model_cls, tok_kind, extra, how = FAMILIES[name]
    config = getattr(transformers, config_cls)(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                               num_attention_heads=4, max_position_embeddings=128, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():               # non-trivial norms and biases (ones / zeros at init)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(name)
    _save(model, path, how)
    _tokenizer(path, tok_kind)
    return name, path, model


def _padded_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V - 20, (3, 11), generator=g)
    valid = torch.ones(3, 11, dtype=torch.bool)
    valid[1, 7:] = False
    valid[2, 4:] = False
    return ids, valid


def _native_logits(model):
    """The native model's logits on the padded batch: causal over the real tokens, positions 0..10."""
    ids, valid = _padded_batch()
    keep = torch.ones(11, 11, dtype=torch.bool).tril()[None] & valid[:, None, :]
    with torch.no_grad():
        return model(ids, torch.arange(11).expand(3, 11), keep)


def _transformers_logits(reference):
    ids, valid = _padded_batch()
    with torch.no_grad():
        return reference(ids, attention_mask=valid.long()).logits


def _assert_same_logits(model, reference):
    """The native model's logits equal transformers' on the real tokens of the padded batch (1e-5, fp32)."""
    valid = _padded_batch()[1]
    torch.testing.assert_close(_native_logits(model)[valid], _transformers_logits(reference)[valid],
                               rtol=1e-5, atol=1e-5)


def test_imported_model_gives_transformers_logits_and_exports_back_bit_identically(mcore, family, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from setdiff_mega.checkpoint import families

    name, path, reference = family
    model, cfg, tok, adapter = families.load_family(path, ["objective.name=ar"])
    assert adapter.name == name and cfg.model.family == name and model.vocab_size == V
    _assert_same_logits(model, reference)

    ck = families.import_model(path, tmp_path / "native", ["objective.name=ar"])
    out = families.export_model(ck, tmp_path / "back")
    back = {}
    for f in sorted(out.glob("*.safetensors")):
        back.update(load_file(str(f)))
    original = {k: v for k, v in reference.state_dict().items()
                if not (reference.config.tie_word_embeddings and k == "lm_head.weight")}
    assert set(back) == set(original)
    for k, v in original.items():
        assert torch.equal(back[k], v), k
    again = AutoModelForCausalLM.from_pretrained(str(out)).eval()       # plain transformers, no remote code
    valid = _padded_batch()[1]
    torch.testing.assert_close(_transformers_logits(again)[valid], _transformers_logits(reference)[valid])


def test_the_projects_export_of_an_imported_model_gives_transformers_logits(mcore, family, tmp_path):
    from transformers import AutoModel

    from setdiff_mega.checkpoint import convert, families

    name, path, reference = family
    ck = families.import_model(path, tmp_path / "native", ["objective.name=ar"])
    exported = AutoModel.from_pretrained(str(convert.export(ck, tmp_path / "hf")), trust_remote_code=True).eval()
    valid = _padded_batch()[1]
    torch.testing.assert_close(_transformers_logits(exported)[valid], _transformers_logits(reference)[valid],
                               rtol=1e-5, atol=1e-5)


def test_a_shifted_setdlm_of_an_imported_model_starts_from_its_next_token_log_probs(mcore, family):
    """Imported AR -> SetDLM with D = 1 and ``model.shift_logits``: at step 0 with the identity order every
    target's log-probabilities are transformers' next-token log-probabilities (the adaptation starts from the
    pretrained model), and the SetDLM loss equals the AR loss on the same batch."""
    import torch.nn.functional as F

    from setdiff_mega.build import objective_for
    from setdiff_mega.checkpoint import families
    from setdiff_mega.diffusion import build_objective

    name, path, reference = family
    model, cfg, tok, _ = families.load_family(path, ["objective.name=setdlm", "objective.D=1",
                                                     "model.shift_logits=true"])
    objective = objective_for(cfg, tok)
    ids, valid = _padded_batch()
    context = torch.zeros_like(valid)
    context[:, 0] = True                                        # the first token is given, as a BOS is
    inp = objective.build_inputs(ids, context=context, padding=~valid, perm=torch.arange(11).expand(3, 11))
    with torch.no_grad():
        logits = inp.target_logits(model(**inp.model_kwargs())).float()
        ref = _transformers_logits(reference).float()
    ref[..., tok.mask] = float("-inf")                          # our losses exclude the MASK class
    logits[..., tok.mask] = float("-inf")
    scored = inp.loss_mask[:, 1:]
    assert int(scored.sum()) == int(valid[:, 1:].sum())
    ours = F.log_softmax(logits[:, 1:], -1)[scored]
    expected = F.log_softmax(ref[:, :-1], -1)[scored]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    ar = build_objective("ar", tok.mask, shift_logits=True)
    ar_inp = ar.build_inputs(ids, context=context, padding=~valid)
    with torch.no_grad():
        torch.testing.assert_close(objective.loss(model(**inp.model_kwargs()), inp)[0],
                                   ar.loss(model(**ar_inp.model_kwargs()), ar_inp)[0], rtol=1e-5, atol=1e-5)


def test_mask_token_and_adopted_tokenizer(mcore, family):
    from setdiff_mega.checkpoint import families

    name, path, _ = family
    model, cfg, tok, _ = families.load_family(path, ["objective.name=setdlm"])
    expected = "<|reserved_special_token_0|>" if name == "llama" else "<|fim_middle|>"
    assert tok.token(tok.mask) == expected and model.vocab_size == V          # an existing token: no new row
    assert tok.token(tok.eos) == ("<|end_of_text|>" if name == "llama" else "<|endoftext|>")
    assert (tok.chat_template == TEMPLATE) == (name != "llama")


def test_a_new_mask_token_gets_the_mean_rows(mcore, tmp_path):
    import transformers

    from setdiff_mega.checkpoint import families

    config = transformers.Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = transformers.Qwen3ForCausalLM(config)
    model.save_pretrained(str(tmp_path))
    _tokenizer(tmp_path, "llama")            # no <|fim_middle|>: a new MASK token
    from tokenizers import Tokenizer

    known = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab_size()
    ours, cfg, tok, _ = families.load_family(tmp_path, ["objective.name=setdlm"])
    assert tok.token(tok.mask) == "<|mask|>" and tok.mask == known and ours.vocab_size == V
    mean = model.model.embed_tokens.weight[:known].mean(0)
    torch.testing.assert_close(ours.embedding.word_embeddings.weight[tok.mask], mean)
    torch.testing.assert_close(ours.output_layer.weight[tok.mask], model.lm_head.weight[:known].mean(0))


@pytest.mark.parametrize("damage,message", [
    ("unknown", r"model_type 'gpt2' .*is not a supported architecture; supported: llama"),
    ("remote", r"defined only by remote code \(auto_map\), which is never executed; supported"),
    ("missing_shard", r"lists the shard '.*model-00002-of-.*', which is missing.*download the missing shards"),
    ("shape", r"tensor 'model.layers.0.self_attn.k_proj.weight' has shape .*the config's architecture needs"),
    ("tokenizer", r"tokenizer.json' has \d+ tokens, more than the 8 rows of the embedding: .*own tokenizer"),
    ("truncated", r"model-00001-of-.*safetensors' is truncated or unreadable .*download or copy it again"),
])
def test_bad_input_is_one_line_naming_the_file(mcore, family, tmp_path, damage, message):
    import shutil

    from safetensors.torch import load_file, save_file

    from setdiff_mega.checkpoint import CheckpointError, families

    name, path, _ = family
    if name != "llama":
        pytest.skip("one family is enough for the refusals")
    d = tmp_path / "m"
    shutil.copytree(path, d)
    config = json.loads((d / "config.json").read_text())
    if damage in ("unknown", "remote"):
        config["model_type"], config["architectures"] = ("gpt2", ["GPT2LMHeadModel"]) if damage == "unknown" else \
            ("my_model", ["MyModelForCausalLM"])
        if damage == "remote":
            config["auto_map"] = {"AutoModelForCausalLM": "modeling_my.MyModel"}
        (d / "config.json").write_text(json.dumps(config))
    elif damage == "missing_shard":
        next(d.glob("model-00002-of-*.safetensors")).unlink()
    elif damage == "truncated":
        f = next(d.glob("model-00001-of-*.safetensors"))
        f.write_bytes(f.read_bytes()[:100])
    else:
        index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
        key = "model.layers.0.self_attn.k_proj.weight" if damage == "shape" else "model.embed_tokens.weight"
        f = d / index[key]
        tensors = load_file(str(f))
        tensors[key] = tensors[key][:8].clone()
        save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=message):
        families.load_family(d, ["objective.name=ar"])


def _layout_logits(rank, world, ck, tp, pp):
    """The imported checkpoint's logits in a TP x PP layout (PP: the first stage's hidden states sent to the
    last by hand)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from setdiff_mega.checkpoint import load_model
    from setdiff_mega.parallel import initialize

    initialize(tp, pp, seed=1)
    model, _, _, cfg = load_model(ck)
    ids, valid = _padded_batch()
    keep = torch.ones(11, 11, dtype=torch.bool).tril()[None] & valid[:, None, :]
    pos = torch.arange(11).expand(3, 11)
    with torch.no_grad():
        if pp > 1 and ps.is_pipeline_first_stage():
            dist.send(model(ids, pos, keep).contiguous(), rank + 1)
            return None
        if pp > 1:
            hidden = torch.empty(11, 3, cfg.model.hidden_size)
            dist.recv(hidden, rank - 1)
            model.set_input_tensor(hidden)
        return model(ids, pos, keep)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_imported_model_gives_transformers_logits_under_tp_and_pp(mcore, family, tmp_path, tp, pp):
    from setdiff_mega.checkpoint import families
    from setdiff_mega.parallel.local import run_ranks

    name, path, reference = family            # qwen2 is tied: PP = 2 keeps a copy of the embedding on stage 2
    ck = families.import_model(path, tmp_path / "native", ["objective.name=ar"])
    out = run_ranks(_layout_logits, world=2, args=(ck, tp, pp))
    valid, theirs = _padded_batch()[1], _transformers_logits(reference)
    for r in ([0, 1] if pp == 1 else [1]):
        torch.testing.assert_close(out[r][valid], theirs[valid], rtol=1e-5, atol=1e-5)


def test_a_setdlms_qwen3_release_imports_with_its_method(mcore, family, tmp_path):
    """setdlms' Qwen3-backbone release layout (model_type bd3lm, the transformers model under
    ``backbone.model.``, pickled): the architecture from the shapes, the method from the noise config,
    transformers' logits."""
    import shutil

    from setdiff_mega.checkpoint import families

    name, path, reference = family
    if name != "qwen3":
        pytest.skip("the release layout wraps a Qwen3")
    d = tmp_path / "release"
    d.mkdir()
    torch.save({f"backbone.model.{k}": v for k, v in reference.state_dict().items()}, d / "pytorch_model.bin")
    (d / "config.json").write_text(json.dumps({
        "model_type": "bd3lm", "length": 64, "mask_token_id": None,
        "noise_config": {"desired_block_size": 4, "max_block_size": 8, "length": 64},
        "backbone_config": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6}}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / f, d / f)
    model, cfg, tok, adapter = families.load_family(d)
    assert adapter.name == "setdlm-qwen3" and (cfg.objective.name, cfg.objective.D, cfg.objective.S_max) == \
        ("setdlm", 4, 8)
    assert (cfg.model.kv_channels, cfg.model.num_query_groups, cfg.model.qk_layernorm) == (32, 2, True)
    _assert_same_logits(model, reference)


def test_the_import_keeps_a_bf16_checkpoint_in_bf16_and_training_loads_it_in_fp32(mcore, family, tmp_path):
    """``--import-dtype auto``: a bf16 checkpoint is held (and saved) in bf16, the model held once; a
    training run in fp32 loads it (every value exact)."""
    import shutil

    from setdiff_mega.checkpoint import families, load_model

    name, path, reference = family
    if name != "qwen3":
        pytest.skip("one family is enough")
    d = tmp_path / "bf16"
    shutil.copytree(path, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    model, *_ = families.load_family(d, ["objective.name=ar"], dtype="auto")
    assert {p.dtype for n, p in model.named_parameters() if "norm" not in n} == {torch.bfloat16}   # norms: fp32
    ck = families.import_model(d, tmp_path / "native", ["objective.name=ar"])
    fp32, *_ = load_model(ck)
    w = fp32.decoder.layers[0].self_attention.linear_proj.weight
    assert w.dtype == torch.float32
    assert torch.equal(w, reference.model.layers[0].self_attn.o_proj.weight.to(torch.bfloat16).float())


def test_a_pickle_that_holds_code_is_never_run(mcore, family, tmp_path):
    """pytorch_model.bin is read with torch.load(weights_only=True): a pickle that would run code is one
    line, and nothing runs."""
    import pickle
    import shutil

    from setdiff_mega.checkpoint import CheckpointError, families

    name, path, _ = family
    if name != "qwen2":
        pytest.skip("the pickled family")
    d = tmp_path / "m"
    shutil.copytree(path, d)
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    shard = d / "pytorch_model-00001-of-00002.bin"
    for write in (lambda: torch.save({"x": Evil()}, shard), lambda: shard.write_bytes(pickle.dumps({"x": Evil()}))):
        write()                                  # the zip format, and a legacy raw pickle
        with pytest.raises(CheckpointError, match="pytorch_model-00001-of-00002.bin' holds more than tensors"):
            families.load_family(d, ["objective.name=ar"])
        assert not marker.exists()
