"""Attention operators: ``mha_prefill``, ``mha_extend_with_kvcache``, ``mha_decode_with_kvcache``,
the decode plan step ``mha_decode_plan`` (select once, plan per batch layout, run) and the
step plans ``mha_prefill_plan`` / ``mha_extend_plan`` / ``mha_decode_step_plan`` (one eager
step's call checked once, run per layer).

Public API and validation in :mod:`.api`, :mod:`.plan` and :mod:`.step_plan`; the kernel-facing contract in
:mod:`.args`. ``attention_request`` (with :class:`Heads`) builds the selector request of a
call from plain shapes.
"""

from tokenspeed_kernel.ops.attention.api import (
    attention_request,
    mha_decode_with_kvcache,
    mha_extend_with_kvcache,
    mha_prefill,
)
from tokenspeed_kernel.ops.attention.args import Heads
from tokenspeed_kernel.ops.attention.plan import DecodePlan, mha_decode_plan
from tokenspeed_kernel.ops.attention.step_plan import (
    DecodeStepPlan,
    ExtendPlan,
    PrefillPlan,
    mha_decode_step_plan,
    mha_extend_plan,
    mha_prefill_plan,
)

__all__ = [
    "DecodePlan",
    "DecodeStepPlan",
    "ExtendPlan",
    "Heads",
    "PrefillPlan",
    "attention_request",
    "mha_decode_plan",
    "mha_decode_step_plan",
    "mha_decode_with_kvcache",
    "mha_extend_plan",
    "mha_extend_with_kvcache",
    "mha_prefill",
    "mha_prefill_plan",
]
