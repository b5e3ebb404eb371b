"""FlashAttention-4's Hopper forward (CuTe DSL, ``flash_attn/cute/flash_fwd_sm90.py``) as a
ragged prefill (``attention.prefill``), sm_90 only.

FA4 4.0.0b36's sm_90 forward: TMA loads, warp-specialized ``wgmma`` with intra-warpgroup
overlap, GQA packed into the M tile, bottom-right causal and sliding-window masks, learnable
sinks, varlen through ``cu_seqlens``. Served through one of two routes (see :mod:`._fa4`):
an AOT bundle compiled on a CPU machine (``TOKENSPEED_KERNEL_FA4_AOT``), or the ``cutedsl``
extra, which compiles each variant on its first call. Without either, ``explain`` shows
the reason.

Ranked first for unwindowed prefill at head dims 64 and 128 (``rank_when``), opt-in elsewhere,
from its first H100 run (2026-11-27, AOT bundle; docs/benchmarks.md): float64 numerics passed (GPU tests
including bottom-right causal, empty key runs and graph replay; ``check --preset awkward``), and
causal S = 8192 with sinks took 0.999 ms (550 TFLOP/s): 1.54x ``triton_prefill`` and 1.18x cuDNN
SDPA without sinks; B = 4 x 4096, 1.40x and 1.11x. With the 128-token window it is slower (0.72x
``triton_prefill``), so windowed calls keep the kernels measured first there. Head dim 128 on an
H200 (2026-11-27, same run as ``gluon_prefill_fa3_sm90``, ci/device/fa3_sweep.py): S = 8192
645 TFLOP/s, B = 4 x 4096 587, against ``gluon_prefill_fa3_sm90`` 595 / 541 and
``triton_prefill`` 259 / 244; at head dim 64 FA4 536 / 481, the Gluon kernel 434 / 416.
"""

from __future__ import annotations

from tokenspeed_kernel.ops.attention.args import PrefillArgs
from tokenspeed_kernel.registry import Priority, register_kernel
from tokenspeed_kernel_nvidia.ops.attention._common import Q_DTYPES, VENDORS
from tokenspeed_kernel_nvidia.ops.attention._fa4 import fa4_missing, fa4_predicate, run

# FA4's sm_90 tile table goes up to D = 256; claimed are the head dims the AOT bundle builds
# and the GPU tests cover (equal q/k and v dims). fp8 is sm_100-only in FA4; logit_cap would
# be a score_mod compiled per cap value, so it is not offered.
HEAD_DIMS = (64, 128)
FEATURES = ("non_causal", "sinks", "sliding_window", "return_lse")


@register_kernel(
    "attention.prefill",
    name="fa4_prefill_sm90",
    solution="cutedsl",
    vendors=VENDORS,
    archs=("sm_90",),  # the cubins are sm_90a
    capabilities=("tma", "wgmma"),
    dtypes={"q": Q_DTYPES, "kv": Q_DTYPES},
    shapes={"head_dim": HEAD_DIMS, "head_dim_v": HEAD_DIMS},
    features=FEATURES,
    priority=Priority.OPT_IN,
    # Measured fastest unwindowed at D = 64 (H100, H200) and D = 128 (H200) (module docstring):
    # above gluon_prefill_fa3_sm90 (PERFORMANT) and triton_prefill (PORTABLE); window calls
    # never reach this rank (gluon_prefill_window_sm90 / triton_prefill were faster there).
    rank_when=({"window_left": (None,), "head_dim": (64, 128)}, Priority.PERFORMANT + 10),
    predicate=fa4_predicate,
    available=fa4_missing,
    # FlashAttention-4's CuTe DSL kernel as shipped multiplies masked probabilities by V in the
    # MMA (0 x NaN = NaN): a NaN/inf in a key or value a query cannot see reaches it (measured
    # on an H200, 2026-11-28; docs/nvidia.md)
    unseen_safe=False,
    # One launch on the caller's stream (TVM-FFI's environment stream), no host reads of
    # lengths; the first call of a variant loads (AOT) or compiles (JIT) it, so warm up
    # before capture. Not yet captured on a GPU.
    graph_safe=True,
)
def fa4_prefill_sm90(args: PrefillArgs) -> None:
    """FA4 sm_90 forward over ragged q ``[total_q, Hq, D]`` and k/v ``[total_k, Hkv, D]``
    (bf16/fp16, contiguous, 16-byte aligned); writes ``args.out`` ``[total_q, Hq, D]`` and
    ``args.lse`` (float32 ``[total_q, Hq]``, via FA4's ``[Hq, total_q]``) when given."""
    run(args)
