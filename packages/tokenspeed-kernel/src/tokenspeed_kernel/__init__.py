"""tokenspeed-kernel: portable operator APIs for LLM inference, a kernel registry and selector.

Engines call the public operators below and never name hardware. Behind each call the
selector picks the best registered kernel for the platform and the request (see
:mod:`tokenspeed_kernel.selector`); ``explain`` shows why.

Import order of the core, top-down: ``config`` → ``platform`` → ``operators`` →
``registry`` → ``selector`` → ``ops.<family>`` (public API + validation) → ``reference``
(pure-PyTorch kernels, loaded lazily as the built-in backend) → ``tools`` / ``cli``.
"""

from tokenspeed_kernel.ops.attention import mha_decode_with_kvcache, mha_extend_with_kvcache, mha_prefill
from tokenspeed_kernel.ops.kvcache import store_kvcache
from tokenspeed_kernel.ops.moe import MoEPlan, moe_apply, moe_plan, moe_topk
from tokenspeed_kernel.platform import Platform, current_platform
from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight
from tokenspeed_kernel.registry import Priority, Request, backends, kernels, register_kernel
from tokenspeed_kernel.selector import KernelOverrideError, NoKernelFoundError, explain, select

__version__ = "2026.11.0"

__all__ = [
    "FP8Weight",
    "KernelOverrideError",
    "MXFP4Weight",
    "MoEPlan",
    "NoKernelFoundError",
    "Platform",
    "Priority",
    "Request",
    "backends",
    "current_platform",
    "explain",
    "kernels",
    "mha_decode_with_kvcache",
    "mha_extend_with_kvcache",
    "mha_prefill",
    "moe_apply",
    "moe_plan",
    "moe_topk",
    "register_kernel",
    "select",
    "store_kvcache",
]
