"""tokenspeed-kernel-vllm: the vLLM plugin of tokenspeed-kernel.

Installed next to vLLM (targeted: 0.33.0), it registers itself through vLLM's entry-point
group ``vllm.general_plugins``; vLLM calls :func:`register` in every process it starts.

- The attention backend ``TOKENSPEED``: ``vllm serve MODEL --attention-backend TOKENSPEED``.
- MoE methods (opt-in): unquantized bf16/fp16 experts through vLLM's out-of-tree
  replacement of ``UnquantizedFusedMoEMethod``, and GPT-OSS's MXFP4 experts through the
  quantization method ``tokenspeed_mxfp4`` (claimed by vLLM's ``override_quantization_method``
  hook), both served by ``moe_topk`` / ``moe_plan`` / ``moe_apply``.

The plugin calls only the public API of ``tokenspeed_kernel``; the selector picks the kernels
among whatever vendor wheels are installed.
"""

from tokenspeed_kernel_vllm._plugin import BACKEND_NAME, MOE_ENV, MXFP4_METHOD, moe_enabled, register

__all__ = ["BACKEND_NAME", "MOE_ENV", "MXFP4_METHOD", "moe_enabled", "register"]


def __getattr__(name: str) -> str:
    """``__version__``: the core's (one version for every wheel, and this wheel pins the core to
    it), read on first use: importing the plugin does not import the core."""
    if name == "__version__":
        from tokenspeed_kernel._version import __version__

        return __version__
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
