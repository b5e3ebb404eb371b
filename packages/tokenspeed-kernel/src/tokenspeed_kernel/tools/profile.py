"""``profile``: a torch.profiler Chrome trace of each selected kernel on a preset's cases.

Each call runs inside ``record_function("<op>:<kernel>")`` so the trace names the kernel
the selector picked (or the one forced with ``kernel=``). Open the JSON in
chrome://tracing or Perfetto.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, record_function
from torch.profiler import profile as _profile

from tokenspeed_kernel import selector
from tokenspeed_kernel.ops._dispatch import last_kernel
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.common import named_kernels, resolve_device
from tokenspeed_kernel.tools.presets import preset_cases

__all__ = ["profile"]


def profile(
    op: str,
    out_path: str,
    *,
    preset: str = "gpt-oss-120b",
    kernel: str | None = None,
    device: str | torch.device | None = None,
    iterations: int = 3,
) -> list[str]:
    """Write a Chrome trace to ``out_path``; return the ``op:kernel`` names recorded."""
    dev = resolve_device(device)
    selector.env_overrides()
    if kernel is not None:
        named_kernels(op, [kernel])
    work = [(case, cases.make_inputs(case, dev, seed=0)) for case in preset_cases(preset, op)]
    names = []
    for case, inputs in work:  # warm up (compilation, autotuning) outside the trace
        cases.call(case, inputs, override=kernel)
        names.append(f"{op}:{last_kernel()} [{case.describe()}]")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with _profile(activities=activities) as prof:
        for _ in range(iterations):
            for (case, inputs), name in zip(work, names):
                with record_function(name):
                    cases.call(case, inputs, override=kernel)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    prof.export_chrome_trace(out_path)
    return names
