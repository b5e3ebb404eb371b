"""Triton MoE kernels: router top-k and the fused expert computation (registered on import):
``triton_fused_moe`` (every weight format), ``triton_fused_moe_mx`` (``tl.dot_scaled`` MXFP4
main loop, GPU only), the opt-in ``triton_fused_moe_mx_swap`` (MXFP4 weight decoded in
registers as the left MMA operand, sm_90), its opt-in persistent form
``triton_fused_moe_mx_swap_persistent``, the two-launch GEMV MoEs for T <= 8 tokens
(``gemv``: ``triton_moe_gemv_mx`` for MXFP4 weights, the opt-in ``triton_moe_gemv`` for
bf16/fp16/fp32 weights); and the expert-parallel exchange's ``triton_moe_dispatch`` /
``triton_moe_combine`` (opt-in; ``ep``)."""

from tokenspeed_kernel_triton.ops.moe import (  # noqa: F401
    ep,
    fused,
    fused_mx,
    fused_mx_swap,
    fused_mx_swap_persistent,
    gemv,
    topk,
)
