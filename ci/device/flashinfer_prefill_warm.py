"""First call of each FlashInfer prefill variant the length sweep needs, timed on its own.

FlashInfer JIT-compiles a kernel module on its first use (25-100 s each on the H100
machine), which must not land in a timed row or cost a bench run its time limit. This builds
(or loads from ``FLASHINFER_WORKSPACE_BASE`` / FlashInfer's cache) the modules behind
``--preset prefill-lengths`` with tiny GPT-OSS-headed inputs, and prints each first-call time.
Run by ``verify_pending.sh prefill`` before the bench.
"""

from __future__ import annotations

import time

import torch

from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.cases import AttentionCase

# The variants of the sweep: causal with sinks (FlashInfer's sink wrapper), causal without
# sinks (its plain paged wrapper), non-causal with sinks (the sink wrapper again).
_VARIANTS = (("sinks", True, True), ("no sinks", False, True), ("non-causal, sinks", True, False))


def main() -> None:
    dev = torch.device("cuda")
    for label, sinks, causal in _VARIANTS:
        case = AttentionCase("attention.prefill", (64, 17), (64, 17), 64, 8, 64, sinks=sinks, causal=causal)
        inputs = cases.make_inputs(case, dev, seed=0)
        start = time.perf_counter()
        cases.call(case, inputs, override="flashinfer_prefill")
        torch.cuda.synchronize(dev)
        print(f"flashinfer_prefill first call ({label}): {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
