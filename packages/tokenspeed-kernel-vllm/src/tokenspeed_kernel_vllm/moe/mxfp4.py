"""GPT-OSS MXFP4 experts through vLLM's quantization-method override hook.

vLLM 0.33 picks a checkpoint's quantization config by asking every registered method's
``override_quantization_method(hf_quant_cfg, user_quant, hf_config)``, custom ones first. The
plugin registers :class:`TokenspeedMxfp4Config` as ``tokenspeed_mxfp4``; it claims GPT-OSS
checkpoints whose ``quant_method`` is ``mxfp4`` when the user asks for it
(``--quantization tokenspeed_mxfp4``) or sets ``TOKENSPEED_VLLM_MOE=1``, and otherwise leaves
them to vLLM's own ``gpt_oss_mxfp4``.

What vLLM's interface forced:

- ``get_name()`` stays ``"gpt_oss_mxfp4"`` (the checkpoint format): vLLM's expert weight
  loader and GPT-OSS's loader branch on that name to load the combined MXFP4 expert tensors.
  The registry key (what ``--quantization`` takes) is ``tokenspeed_mxfp4``.
- Layers other than the experts (linear layers, attention) are answered exactly as vLLM's
  ``GptOssMxfp4Config`` answers them (that config is consulted for them).
- The expert parameters are the ones vLLM's GPT-OSS MXFP4 method creates (same names,
  shapes, dtypes): ``w13_weight`` uint8 ``[E, 2I, H/2]`` (two E2M1 codes a byte, low nibble
  first), ``w13_weight_scale`` uint8 ``[E, 2I, H/32]`` (E8M0), ``w2_weight`` ``[E, H, I/2]``,
  ``w2_weight_scale`` ``[E, H, I/32]``, bf16 biases ``[E, 2I]``/``[E, H]``; they are exactly
  tokenspeed-kernel's ``MXFP4Weight(packed, scales)`` once w13's gate/up rows are
  de-interleaved.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from tokenspeed_kernel_vllm._plugin import MXFP4_METHOD, moe_enabled

_MX_BLOCK = 32


class TokenspeedMxfp4Config(QuantizationConfig):
    """The ``tokenspeed_mxfp4`` quantization method: GPT-OSS MXFP4 experts on tokenspeed-kernel."""

    def __init__(self) -> None:
        super().__init__()
        self._vllm_config: QuantizationConfig | None = None

    @classmethod
    def get_name(cls) -> Any:
        return "gpt_oss_mxfp4"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TokenspeedMxfp4Config:
        return cls()

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: Any, user_quant: str | None, hf_config: Any = None) -> Any:
        if not isinstance(hf_quant_cfg, dict) or hf_quant_cfg.get("quant_method") not in ("mxfp4", "gpt_oss_mxfp4"):
            return None
        if getattr(hf_config, "model_type", None) != "gpt_oss":
            return None
        if user_quant == MXFP4_METHOD or (user_quant is None and moe_enabled()):
            return MXFP4_METHOD
        return None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.fused_moe import RoutedExperts

        if isinstance(layer, RoutedExperts):
            return moe_method_class()(layer.moe_config)
        if self._vllm_config is None:
            from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config

            self._vllm_config = GptOssMxfp4Config()
        return self._vllm_config.get_quant_method(layer, prefix)


_METHOD_CLASS: list[type] = []


def moe_method_class() -> type:
    """``TokenspeedMxfp4MoEMethod``, built on first use: it subclasses vLLM's
    ``FusedMoEMethodBase``, whose package is heavy to import, and registering the config
    (every vLLM process, at plugin load) should not pay for it."""
    if not _METHOD_CLASS:
        _METHOD_CLASS.append(_make_method_class())
    return _METHOD_CLASS[0]


def _make_method_class() -> type:
    from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
    from vllm.model_executor.utils import set_weight_attrs

    from tokenspeed_kernel import MXFP4Weight
    from tokenspeed_kernel_vllm.moe._common import TokenspeedMoEMixin, activation_for, deinterleave_rows_

    class TokenspeedMxfp4MoEMethod(TokenspeedMoEMixin, FusedMoEMethodBase):
        """GPT-OSS MXFP4 experts: vLLM's parameter layout, tokenspeed-kernel's kernels."""

        # vLLM's expert weight loader reads this to load packed MXFP4 rows.
        weight_dtype = "gpt_oss_mxfp4"

        def create_weights(
            self,
            layer: torch.nn.Module,
            num_experts: int,
            hidden_size: int,
            intermediate_size_per_partition: int,
            params_dtype: torch.dtype,
            **extra_weight_attrs: Any,
        ) -> None:
            if hidden_size % _MX_BLOCK or intermediate_size_per_partition % _MX_BLOCK:
                raise ValueError(
                    f"tokenspeed MXFP4 MoE: hidden ({hidden_size}) and per-rank intermediate "
                    f"({intermediate_size_per_partition}) sizes must be multiples of {_MX_BLOCK}"
                )
            rows = self.moe.w13_num_shards * intermediate_size_per_partition
            shapes = {
                "w13_weight": ((num_experts, rows, hidden_size // 2), torch.uint8),
                "w13_weight_scale": ((num_experts, rows, hidden_size // _MX_BLOCK), torch.uint8),
                "w2_weight": ((num_experts, hidden_size, intermediate_size_per_partition // 2), torch.uint8),
                "w2_weight_scale": (
                    (num_experts, hidden_size, intermediate_size_per_partition // _MX_BLOCK),
                    torch.uint8,
                ),
            }
            if self.moe.has_bias:
                shapes["w13_bias"] = ((num_experts, rows), torch.bfloat16)
                shapes["w2_bias"] = ((num_experts, hidden_size), torch.bfloat16)
            layer.params_dtype = params_dtype
            layer.num_experts = num_experts
            for name, (shape, dtype) in shapes.items():
                param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
                layer.register_parameter(name, param)
                set_weight_attrs(param, extra_weight_attrs)
                if name.endswith("_scale"):
                    param.quant_method = "block"

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            """De-interleave w13's gate/up rows (packed bytes, scales, bias; in place), then
            plan the experts with ``MXFP4Weight`` views of the parameters."""
            _, interleaved = activation_for(layer)
            w13_bias = getattr(layer, "w13_bias", None)
            if interleaved:
                deinterleave_rows_(layer.w13_weight, layer.w13_weight_scale, w13_bias)
            self._make_plan(
                layer,
                MXFP4Weight(layer.w13_weight.data, layer.w13_weight_scale.data),
                MXFP4Weight(layer.w2_weight.data, layer.w2_weight_scale.data),
                w13_bias,
                getattr(layer, "w2_bias", None),
            )

        def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> None:
            return None

    TokenspeedMxfp4MoEMethod.__module__ = __name__
    return TokenspeedMxfp4MoEMethod
