"""Unquantized (bf16/fp16/fp32) experts through vLLM's out-of-tree op replacement.

vLLM 0.33 instantiates ``UnquantizedFusedMoEMethod`` for every MoE layer without a
quantization config; ``UnquantizedFusedMoEMethod.register_oot(cls)`` makes it build ``cls``
instead (the plugin registers this class when ``TOKENSPEED_VLLM_MOE=1``). The weights are
vLLM's own parameters, created by the parent's ``create_weights`` (``w13 [E, 2I, H]``,
``w2 [E, H, I]``, optional biases), served by ``moe_plan``/``moe_apply``/``moe_topk``.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

from tokenspeed_kernel_vllm.moe._common import TokenspeedMoEMixin, activation_for, deinterleave_rows_


class TokenspeedUnquantizedFusedMoEMethod(TokenspeedMoEMixin, UnquantizedFusedMoEMethod):
    """``UnquantizedFusedMoEMethod`` whose experts (and routing, when monolithic) run on
    tokenspeed-kernel."""

    def __init__(self, moe: Any) -> None:
        # The parent's __init__ picks one of vLLM's kernels; this method brings its own.
        FusedMoEMethodBase.__init__(self, moe)
        self.unquantized_backend = UnquantizedMoeBackend.OOT
        self.experts_cls = None
        self.supports_pre_processed_weights = False

    @property
    def method_name(self) -> str:
        return "TokenspeedUnquantizedFusedMoEMethod"

    def process_weights_after_loading(self, layer: Any) -> None:
        """De-interleave GPT-OSS-style w13 rows (in place), then plan the experts."""
        _, interleaved = activation_for(layer)
        w13_bias = getattr(layer, "w13_bias", None)
        if interleaved:
            deinterleave_rows_(layer.w13_weight, w13_bias)
        self._make_plan(layer, layer.w13_weight.data, layer.w2_weight.data, w13_bias, getattr(layer, "w2_bias", None))

    def get_fused_moe_quant_config(self, layer: Any) -> None:
        return None

    def forward_native(self, layer: Any, x: Any, topk_weights: Any, topk_ids: Any, *args: Any, **kwargs: Any) -> Any:
        return self.apply(layer, x, topk_weights, topk_ids)

    forward_cuda = forward_native
    forward_cpu = forward_native
    forward_hip = forward_native
    forward_xpu = forward_native
    forward_oot = forward_native
