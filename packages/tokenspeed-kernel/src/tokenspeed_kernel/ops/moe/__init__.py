"""Mixture-of-experts operators: router top-k, expert computation, weight plans, and the
expert-parallel token exchange.

``moe_topk`` scores router logits and picks ``top_k`` experts per token; ``moe_apply``
runs the chosen experts and combines their outputs; ``moe_plan`` selects a kernel once
for fixed weights and lets it repack them (see :class:`MoEPlan`). Across the ranks of a
process group, ``moe_dispatch`` sends each token to the ranks holding its experts and
``moe_combine`` brings their outputs back; ``moe_dispatch_plan`` plans that exchange once,
with capacity-bounded buffers, for CUDA graphs (see :class:`MoEDispatchPlan`).
"""

from tokenspeed_kernel.ops.moe.api import moe_apply, moe_apply_request, moe_topk, moe_topk_request
from tokenspeed_kernel.ops.moe.args import MoEDispatched, MoEDispatchHandle
from tokenspeed_kernel.ops.moe.ep import moe_combine, moe_dispatch
from tokenspeed_kernel.ops.moe.ep_plan import MoEDispatchPlan, moe_dispatch_plan
from tokenspeed_kernel.ops.moe.plan import MoEPlan, moe_plan

__all__ = [
    "MoEDispatchHandle",
    "MoEDispatchPlan",
    "MoEDispatched",
    "MoEPlan",
    "moe_apply",
    "moe_apply_request",
    "moe_combine",
    "moe_dispatch",
    "moe_dispatch_plan",
    "moe_plan",
    "moe_topk",
    "moe_topk_request",
]
