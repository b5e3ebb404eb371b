"""Mixture-of-experts operators: router top-k, expert computation, and weight plans.

``moe_topk`` scores router logits and picks ``top_k`` experts per token; ``moe_apply``
runs the chosen experts and combines their outputs; ``moe_plan`` selects a kernel once
for fixed weights and lets it repack them (see :class:`MoEPlan`).
"""

from tokenspeed_kernel.ops.moe.api import moe_apply, moe_apply_request, moe_topk, moe_topk_request
from tokenspeed_kernel.ops.moe.plan import MoEPlan, moe_plan

__all__ = ["MoEPlan", "moe_apply", "moe_apply_request", "moe_plan", "moe_topk", "moe_topk_request"]
