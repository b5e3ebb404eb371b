"""Triton MoE kernels: router top-k and the fused expert computation (registered on import):
``triton_fused_moe`` (every weight format) and the opt-in ``triton_fused_moe_mx``
(``tl.dot_scaled`` MXFP4 main loop, GPU only)."""

from tokenspeed_kernel_triton.ops.moe import fused, fused_mx, topk  # noqa: F401
