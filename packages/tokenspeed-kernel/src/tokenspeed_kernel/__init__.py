"""tokenspeed-kernel: portable operator APIs for LLM inference, a kernel registry and selector.

Engines call the public operators below and never name hardware (expert parallelism:
``moe_dispatch``/``moe_combine`` move tokens between the ranks of a ``torch.distributed``
process group). Behind each call the
selector picks the best registered kernel for the platform and the request (see
:mod:`tokenspeed_kernel.selector`); ``explain`` shows why. Plans (``mha_decode_plan``,
``mha_prefill_plan``, ``mha_extend_plan``, ``moe_plan``) select once and let the kernel prepare (batch layout,
weights) outside the hot path. ``attention_request``/``store_request`` build a call's request from plain
shapes, so ``select``/``explain`` answer "which kernel would serve this call" before it is
made; ``last_kernel()`` names the kernel that served the last call.

Import order of the core, top-down: ``config`` → ``platform`` → ``operators`` →
``registry`` → ``kit`` → ``selector`` → ``ops._operator`` (one ``Operator`` object per operator
and the call path) → ``ops.<family>`` (public API + plans + validation) → ``reference``
(pure-PyTorch kernels, loaded lazily as the built-in backend) → ``tools`` / ``cli``.
"""

from tokenspeed_kernel._version import __version__ as __version__
from tokenspeed_kernel.ops._dispatch import last_kernel
from tokenspeed_kernel.ops.attention import (
    DecodePlan,
    DecodeStepPlan,
    ExtendPlan,
    Heads,
    PrefillPlan,
    attention_request,
    mha_decode_plan,
    mha_decode_step_plan,
    mha_decode_with_kvcache,
    mha_extend_plan,
    mha_extend_with_kvcache,
    mha_prefill,
    mha_prefill_plan,
)
from tokenspeed_kernel.ops.kvcache import store_kvcache, store_request
from tokenspeed_kernel.ops.moe import (
    MoEDispatched,
    MoEDispatchHandle,
    MoEDispatchPlan,
    MoEPlan,
    moe_apply,
    moe_apply_request,
    moe_combine,
    moe_dispatch,
    moe_dispatch_plan,
    moe_plan,
    moe_topk,
    moe_topk_request,
)
from tokenspeed_kernel.platform import Platform, current_platform, platform_for
from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight
from tokenspeed_kernel.registry import Priority, Request, backends, kernels, register_kernel
from tokenspeed_kernel.selector import KernelOverrideError, NoKernelFoundError, explain, select

__all__ = [
    "DecodePlan",
    "DecodeStepPlan",
    "ExtendPlan",
    "FP8Weight",
    "Heads",
    "KernelOverrideError",
    "MXFP4Weight",
    "MoEDispatchHandle",
    "MoEDispatchPlan",
    "MoEDispatched",
    "MoEPlan",
    "NoKernelFoundError",
    "Platform",
    "PrefillPlan",
    "Priority",
    "Request",
    "attention_request",
    "backends",
    "current_platform",
    "explain",
    "kernels",
    "last_kernel",
    "mha_decode_plan",
    "mha_decode_step_plan",
    "mha_decode_with_kvcache",
    "mha_extend_plan",
    "mha_extend_with_kvcache",
    "mha_prefill",
    "mha_prefill_plan",
    "moe_apply",
    "moe_apply_request",
    "moe_combine",
    "moe_dispatch",
    "moe_dispatch_plan",
    "moe_plan",
    "moe_topk",
    "moe_topk_request",
    "platform_for",
    "register_kernel",
    "select",
    "store_kvcache",
    "store_request",
]
