"""Discovery and validation through vLLM's own code.

- vLLM's plugin loader finds our ``vllm.general_plugins`` entry point (the wheel must be
  installed, as CI does) and, once it ran, vLLM's registry and config parser resolve
  ``TOKENSPEED`` (what ``--attention-backend TOKENSPEED`` does) to our backend class.
- Bad input from vLLM fails at vLLM's backend validation with our reason:
  ``validate_configuration`` is called exactly as vLLM's CUDA and ROCm platforms call it
  (``AttentionSelectorConfig._asdict()`` plus the device capability); those platforms turn
  a non-empty list into "Selected backend TOKENSPEED is not valid for this configuration.
  Reason: [...]" (their modules need a GPU build to import; ci/device/vllm_compare.py goes
  through the CUDA one). A layer built anyway fails at construction, inside vLLM's
  ``Attention``, with the selector's reason for its exact shapes.
"""

from __future__ import annotations

import pytest
import torch


def test_vllm_plugin_loader_discovers_the_entry_point(monkeypatch):
    import tokenspeed_kernel_vllm
    import vllm.plugins
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_general_plugins, load_plugins_by_group

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    found = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert found.get("tokenspeed") is tokenspeed_kernel_vllm.register, (
        f"vLLM's loader did not find the entry point tokenspeed = tokenspeed_kernel_vllm:register "
        f"(is packages/tokenspeed-kernel-vllm pip-installed?); found {sorted(found)}"
    )
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    load_general_plugins()  # runs every general plugin, ours included
    load_general_plugins()  # vLLM may load plugins again: a no-op the second time
    tokenspeed_kernel_vllm.register()  # and ours is idempotent on its own


def test_tokenspeed_resolves_by_name():
    import tokenspeed_kernel_vllm
    from tokenspeed_kernel_vllm.attention.backend import TokenspeedAttentionBackend
    from vllm.config import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    tokenspeed_kernel_vllm.register()
    assert AttentionBackendEnum["TOKENSPEED"].get_class() is TokenspeedAttentionBackend
    # --attention-backend tokenspeed: vLLM's config parses the string (case-insensitively).
    assert AttentionConfig(backend="tokenspeed").backend.get_class() is TokenspeedAttentionBackend
    assert TokenspeedAttentionBackend.get_name() == "TOKENSPEED"
    assert TokenspeedAttentionBackend.get_impl_cls().__name__ == "TokenspeedAttentionImpl"


def _reasons(**overrides):
    from tokenspeed_kernel_vllm.attention.backend import TokenspeedAttentionBackend
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig

    fields = {"head_size": 64, "dtype": torch.bfloat16, "kv_cache_dtype": "auto", "block_size": 16, "has_sink": True}
    fields |= overrides
    config = AttentionSelectorConfig(**fields, has_sliding_window=True)
    return TokenspeedAttentionBackend.validate_configuration(
        device_capability=DeviceCapability(9, 0), **config._asdict()
    )


def test_gpt_oss_configuration_is_valid():
    assert _reasons() == []
    assert _reasons(kv_cache_dtype="fp8", block_size=32) == []
    assert _reasons(block_size=48) == []  # vLLM splits it into 16-token kernel pages


@pytest.mark.parametrize(
    ("overrides", "ours"),
    [
        pytest.param({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype 'fp8_e5m2' is not served", id="kv-fp8-e5m2"),
        pytest.param(
            {"kv_cache_dtype": "int8_per_token_head"},
            "kv_cache_dtype 'int8_per_token_head' is not served",
            id="kv-int8-per-token-head",
        ),
        pytest.param({"block_size": 8}, "block_size 8 is not a multiple of a kernel page size", id="page-8"),
        pytest.param({"block_size": 24}, "block_size 24 is not a multiple of a kernel page size", id="page-24"),
        pytest.param({"head_size": 72}, "serves attention.decode for head_size 72", id="head-72"),
    ],
)
def test_unserved_configuration_fails_validation_with_our_reason(overrides, ours):
    reasons = _reasons(**overrides)
    assert reasons, f"{overrides} passed validation"
    assert any(r.startswith("TOKENSPEED: ") and ours in r for r in reasons), reasons
    assert not any(r.endswith(" not supported") for r in reasons), reasons  # vLLM's generic words replaced


def test_unserved_layer_fails_inside_vllm_attention(tiny_model_dir):
    """A bad KV dtype that reaches layer construction (the backend forced past selection)
    stops vLLM's Attention.__init__ with our reason."""
    import tokenspeed_kernel_vllm
    from support.vllm_env import make_vllm_config
    from tokenspeed_kernel_vllm.attention.backend import TokenspeedAttentionBackend
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention

    tokenspeed_kernel_vllm.register()
    config = make_vllm_config(tiny_model_dir, kv_cache_dtype="fp8_e5m2")
    with set_current_vllm_config(config), pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2' is not served"):
        Attention(
            8,
            32,
            32**-0.5,
            num_kv_heads=2,
            cache_config=config.cache_config,
            prefix="model.layers.9.attn",
            attn_backend=TokenspeedAttentionBackend,
        )
