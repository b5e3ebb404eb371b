"""The ``vllm.general_plugins`` entry point: what the plugin registers with vLLM, and when.

vLLM loads general plugins in every process it starts (API server, engine core, workers),
possibly more than once per process; :func:`register` is idempotent.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

BACKEND_NAME = "TOKENSPEED"
"""The name ``--attention-backend`` takes."""

BACKEND_PATH = "tokenspeed_kernel_vllm.attention.backend.TokenspeedAttentionBackend"

MXFP4_METHOD = "tokenspeed_mxfp4"
"""The quantization method (``--quantization tokenspeed_mxfp4``) serving GPT-OSS's MXFP4 experts."""

MOE_ENV = "TOKENSPEED_VLLM_MOE"
"""``TOKENSPEED_VLLM_MOE=1`` routes MoE layers to tokenspeed-kernel: unquantized experts
always, GPT-OSS MXFP4 checkpoints without ``--quantization tokenspeed_mxfp4``."""

_registered: set[str] = set()


def moe_enabled() -> bool:
    """Whether ``TOKENSPEED_VLLM_MOE`` asks for the MoE paths (``1``/``true``/``yes``/``on``)."""
    return os.environ.get(MOE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """Register the TOKENSPEED attention backend, the ``tokenspeed_mxfp4`` quantization
    method and, when :data:`MOE_ENV` is set, the unquantized MoE method. Safe to call again."""
    _register_attention()
    _register_mxfp4()
    if moe_enabled():
        _register_unquantized_moe()


def _register_attention() -> None:
    if "attention" in _registered:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if BACKEND_NAME in AttentionBackendEnum.__members__:
        # Another copy of this plugin (or a reload) got there first: point it at us.
        register_backend(AttentionBackendEnum[BACKEND_NAME], BACKEND_PATH)
    else:
        register_backend(BACKEND_NAME, BACKEND_PATH)
    _registered.add("attention")


def _register_mxfp4() -> None:
    if "mxfp4" in _registered:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    from tokenspeed_kernel_vllm.moe.mxfp4 import TokenspeedMxfp4Config

    register_quantization_config(MXFP4_METHOD)(TokenspeedMxfp4Config)
    _registered.add("mxfp4")


def _register_unquantized_moe() -> None:
    if "unquantized_moe" in _registered:
        return
    from vllm.model_executor.custom_op import op_registry_oot

    from tokenspeed_kernel_vllm.moe.unquantized import TokenspeedUnquantizedFusedMoEMethod

    name = "UnquantizedFusedMoEMethod"
    if op_registry_oot.get(name) not in (None, TokenspeedUnquantizedFusedMoEMethod):
        # vLLM allows one out-of-tree replacement per op; another plugin holds this one.
        logger.warning(
            "%s=1 but %s is already replaced by %s; unquantized MoE stays with it",
            MOE_ENV,
            name,
            op_registry_oot[name].__qualname__,
        )
        return
    if name not in op_registry_oot:
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

        UnquantizedFusedMoEMethod.register_oot(TokenspeedUnquantizedFusedMoEMethod)
    _registered.add("unquantized_moe")
