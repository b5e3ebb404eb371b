"""A real vLLM configuration for the plugin tests: a tiny GPT-OSS-shaped model, no weights."""

from __future__ import annotations

# A GPT-OSS-shaped model small enough for the interpreter: 8 query heads, 2 KV heads,
# head dim 32, a sliding window of 8 tokens on even layers. No weights: vLLM only reads the
# config (no download, no tokenizer).
TINY_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 128,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "attention_bias": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def make_vllm_config(model_dir: str, *, block_size: int = 16, kv_cache_dtype: str = "auto", **kwargs):
    """A real ``VllmConfig`` for the tiny model (vLLM's own config classes, CPU platform)."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256)
    cache_config = CacheConfig(block_size=block_size, cache_dtype=kv_cache_dtype)
    return VllmConfig(model_config=model_config, cache_config=cache_config, **kwargs)
