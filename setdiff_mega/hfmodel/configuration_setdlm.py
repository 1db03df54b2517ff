"""Hugging Face configuration of an exported setdiff-mega model (copied next to the weights on export).

Architecture fields follow the usual transformers names; ``method`` records how the model was trained
(objective, D, S_max, block size, MASK / BOS / EOS / PAD ids) so that a sampler can rebuild itself from
the exported directory alone, and ``setdiff_mega`` holds the full training RunConfig so that the export
converts back to a training checkpoint without loss.
"""
from transformers import PretrainedConfig


class SetDLMConfig(PretrainedConfig):
    model_type = "setdlm"

    def __init__(self, vocab_size=512, tokenizer_vocab_size=None, hidden_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=None, intermediate_size=None, hidden_act="gelu",
                 normalization="LayerNorm", norm_eps=1e-5, attention_bias=False, head_bias=True,
                 tie_word_embeddings=False, rope_theta=10000.0, rotary_percent=1.0,
                 max_position_embeddings=4096, method=None, setdiff_mega=None, head_dim=None, qk_norm=False,
                 qkv_bias=None, mlp_bias=None, norm_bias=True, rotary_scaling=None, shift_logits=False, **kwargs):
        self.vocab_size = vocab_size                                   # embedding rows (padded)
        self.tokenizer_vocab_size = tokenizer_vocab_size or vocab_size  # logits are sliced to this
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.intermediate_size = intermediate_size or 4 * hidden_size
        self.head_dim = head_dim or hidden_size // num_attention_heads   # channels per head
        self.hidden_act = hidden_act                                   # gelu (erf) | gelu_tanh | swiglu
        self.normalization = normalization                             # LayerNorm | RMSNorm
        self.norm_eps = norm_eps
        self.norm_bias = norm_bias                                     # LayerNorm's bias
        self.qk_norm = qk_norm                                         # per-head norm on q and k before RoPE
        self.attention_bias = attention_bias                           # o's bias (and the defaults below)
        self.qkv_bias = attention_bias if qkv_bias is None else qkv_bias
        self.mlp_bias = attention_bias if mlp_bias is None else mlp_bias
        self.head_bias = head_bias
        self.shift_logits = shift_logits        # the samplers read a target's logits from its predecessor's row
        self.rotary_scaling = rotary_scaling                           # None or {"rope_type": "llama3", ...}
        self.rope_theta = rope_theta
        self.rotary_percent = rotary_percent
        self.max_position_embeddings = max_position_embeddings
        self.method = dict(method or {"causal": True})     # an export records its method (hf.hf_config)
        self.setdiff_mega = setdiff_mega
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
