"""``bench``: time kernels and same-run baselines; report speed against the device's ceilings.

For each case of a preset (or of a capture file, ``replay=``), every requested kernel is
called through the public operator with ``override=<kernel>`` and every baseline of
:mod:`.baselines` is timed on the same inputs in the same process. Each row gives the median
time, TFLOP/s and TB/s from the case's counted work (``flops()``, ``bytes_moved()``), on a
GPU the share of the measured copy bandwidth and bf16 matmul rate (:mod:`.ceilings`), and
``speedup vs <baseline> = baseline time / kernel time``. The kernel the selector picks is
marked ``*``. On a GPU every implementation is timed through a CUDA graph where it can be
captured (device time, as an engine's decode step runs; a kernel registered
``graph_safe=False`` is not tried); the rows say when it could not. A kernel with a
``prepare`` hook (weight repacking) is timed through its plan (``moe_plan`` once, then
``plan.apply``), as an engine runs it; the others through the functional call.

A kernel that cannot be captured may plan per batch layout on the host (a device-to-host
copy of the ``cu_seqlens``/page table, then host scheduling), and the timing above reuses
one layout, so it plans once. For such a kernel on an operator with a
layout (attention), the row also gives ``relayout_ms``: the time per call when every call
brings new layout tensors (same values), so every call plans: the cost to an engine that
does not share one step's layout tensors across its layers. The pick ``*`` is the
selector's, which ranks by registration, not by this table.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch

from tokenspeed_kernel import registry, selector
from tokenspeed_kernel.ops._dispatch import last_kernel
from tokenspeed_kernel.selector import KernelOverrideError
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.baselines import baselines_for
from tokenspeed_kernel.tools.capture import read_capture
from tokenspeed_kernel.tools.ceilings import Ceilings, ceilings
from tokenspeed_kernel.tools.common import kernels_per_op, provenance, resolve_device, write_json
from tokenspeed_kernel.tools.presets import preset_cases
from tokenspeed_kernel.tools.progress import Progress
from tokenspeed_kernel.tools.timing import Timing, time_fn

__all__ = ["BenchReport", "BenchRow", "bench"]


@dataclass
class BenchRow:
    """One implementation on one case. ``kind`` is ``kernel`` or ``baseline``."""

    op: str
    case: str
    impl: str
    kind: str
    ms: float | None = None
    tflops: float | None = None
    tbps: float | None = None
    pct_copy: float | None = None
    pct_matmul: float | None = None
    selected: bool = False
    speedups: dict[str, float] = field(default_factory=dict)
    note: str = ""
    relayout_ms: float | None = None


@dataclass
class BenchReport:
    device: str
    torch_version: str
    date: str
    ceilings: Ceilings | None
    rows: list[BenchRow] = field(default_factory=list)

    def table(self) -> str:
        lines = [f"device: {self.device}  torch {self.torch_version}  {self.date}"]
        if self.ceilings:
            c = self.ceilings
            lines.append(
                f"ceilings: copy {c.copy_tb_s:.2f} TB/s, bf16 matmul {c.matmul_tflop_s:.0f} TFLOP/s (measured)"
            )
        head = f"  {'impl':<30} {'ms':>9} {'TFLOP/s':>8} {'TB/s':>7} {'%copy':>6} {'%mma':>5}  speedup vs baselines"
        current = None
        for r in self.rows:
            if r.case != current:
                current = r.case
                lines += ["", f"{r.op}: {r.case}", head]
            mark = "*" if r.selected else " "
            if r.ms is None:
                lines.append(f"{mark} {r.impl:<30} {'-':>9}  {r.note}")
                continue
            pct_c = f"{r.pct_copy:>5.0f}%" if r.pct_copy is not None else f"{'':>6}"
            pct_m = f"{r.pct_matmul:>4.0f}%" if r.pct_matmul is not None else f"{'':>5}"
            ups = ", ".join(f"{k} {v:.2f}x" for k, v in r.speedups.items())
            note = f"  [{r.note}]" if r.note else ""
            lines.append(
                f"{mark} {r.impl:<30} {r.ms:>9.4f} {r.tflops or 0:>8.1f} {r.tbps or 0:>7.3f} {pct_c} {pct_m}  {ups}{note}"
            )
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "torch": self.torch_version,
            "date": self.date,
            **provenance(),
            "ceilings": asdict(self.ceilings) if self.ceilings else None,
            "rows": [asdict(r) for r in self.rows],
        }


def _kernel_names(ops: list[str], kernel: str | None) -> Mapping[str, Sequence[str | None]]:
    """Per operator, the implementations to time: ``[None]`` = the selector's choice (no
    ``kernel``); ``"all"`` = every registered kernel; else the named ones (comma-separated,
    ``"triton_prefill,flashinfer_prefill"``) registered for that operator. With several
    operators a named kernel runs on its own operator and the others are left out.

    Raises ``ValueError`` (one line, listing the valid names) for a name registered for none
    of ``ops``.
    """
    if kernel is None:
        return {op: [None] for op in ops}
    if kernel == "all":
        return {op: [spec.name for spec in registry.kernels(op)] for op in ops}
    return kernels_per_op(ops, [name.strip() for name in kernel.split(",") if name.strip()])


def _row(case: cases.Case, impl: str, kind: str, ms: float, ceil: Ceilings | None) -> BenchRow:
    flops, nbytes = case.flops(), case.bytes_moved()
    tflops, tbps = flops / ms / 1e9, nbytes / ms / 1e9
    row = BenchRow(case.op, case.describe(), impl, kind, ms, tflops, tbps)
    if ceil is not None:
        row.pct_copy = 100 * tbps / ceil.copy_tb_s if nbytes else None
        row.pct_matmul = 100 * tflops / ceil.matmul_tflop_s if flops else None
    return row


def _timing_note(timing: Timing, device: torch.device) -> str:
    return "" if timing.graph or device.type != "cuda" else "eager (not graph-capturable)"


def _relayout_ms(case: cases.Case, inputs: dict, name: str | None, device: torch.device) -> float | None:
    """Median time per call when each call brings new layout tensors: the calls alternate
    between ``inputs`` and a copy with fresh layout tensors, so a kernel that plans per layout
    plans every call. None when the operator takes no layout."""
    moved = cases.relayout(case, inputs)
    if moved is None:
        return None
    pool = itertools.cycle((moved, inputs))
    return time_fn(lambda: cases.call(case, next(pool), override=name), device, graph=False).median_ms


def _selected_name(case: cases.Case, inputs: dict) -> str | None:
    """Which kernel the selector picks for this case (one untimed call, no override)."""
    cases.call(case, cases.fresh_copies(inputs))
    return last_kernel()


def _label(case: cases.Case, name: str) -> str:
    lost = [tag for tag, on in (("sinks", getattr(case, "sinks", False)), ("cap", getattr(case, "logit_cap", 0))) if on]
    return name + "".join(f"-no{t}" for t in lost) if case.op.startswith("attention") else name


def bench(
    ops: str | Iterable[str],
    *,
    kernel: str | None = None,
    preset: str = "gpt-oss-120b",
    replay: str | None = None,
    json_path: str | None = None,
    baselines: bool = True,
    device: str | torch.device | None = None,
    stream: TextIO | None = None,
    quiet: bool = False,
) -> BenchReport:
    """Benchmark ``ops`` (a name, ``"all"`` or a list) on a preset or a capture file."""
    dev = resolve_device(device)
    selector.env_overrides()  # an invalid TOKENSPEED_KERNEL_OVERRIDE is an error here, not a row
    ceil = ceilings(dev) if dev.type == "cuda" else None
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    report = BenchReport(name, torch.__version__, datetime.date.today().isoformat(), ceil)
    if replay is not None:
        wanted = set(cases.OPS) if ops == "all" else {ops} if isinstance(ops, str) else set(ops)
        op_list = [op for op in cases.OPS if op in wanted] + sorted(wanted - set(cases.OPS))
        impls = _kernel_names(op_list, kernel)
        work = [(c.op, c) for c in read_capture(replay) if c.op in wanted and impls[c.op]]
    else:
        op_list = list(cases.OPS) if ops == "all" else [ops] if isinstance(ops, str) else list(ops)
        impls = _kernel_names(op_list, kernel)
        work = [(op, c) for op in op_list if impls[op] for c in preset_cases(preset, op)]
    progress = Progress(len(work), stream=sys.stderr)
    for op, case in work:
        progress.step(case.describe())
        inputs = cases.make_inputs(case, dev, seed=0)
        selected = _selected_name(case, inputs)
        kernel_rows: list[BenchRow] = []
        for kname in impls[op]:
            impl = kname or selected or "?"
            try:
                cases.call(case, inputs, override=kname)
            except KernelOverrideError as exc:
                report.rows.append(BenchRow(op, case.describe(), impl, "kernel", note=str(exc).split(": ", 1)[-1]))
                continue
            spec = registry.get_kernel(impl)
            # warmed up by the call above
            run: Callable[[], Any] = functools.partial(cases.call, case, inputs, override=kname)
            if spec.prepare is not None:
                # A kernel with a weight-preparation hook is timed the way an engine runs it: planned
                # once, outside the timing (the functional call would repack the weights every call),
                # and its plan's first call untimed too (one-time work such as a kernel's autotuning).
                run = cases.planned_call(case, inputs, kname)
                run()
            timing = time_fn(run, dev, graph=spec.graph_safe)  # no capture attempt for a kernel that refuses it
            row = _row(case, impl, "kernel", timing.median_ms, ceil)
            row.selected = impl == selected
            row.note = _timing_note(timing, dev)
            if not spec.graph_safe and spec.prepare is None:
                row.relayout_ms = _relayout_ms(case, inputs, kname, dev)
                if row.relayout_ms is not None:
                    row.note = "; ".join(
                        filter(None, (row.note, f"{row.relayout_ms:.4f} ms with a new layout every call"))
                    )
            kernel_rows.append(row)
        base_rows: list[BenchRow] = []
        for baseline in baselines_for(op) if baselines else ():
            runner = baseline.prepare(case, inputs, dev)
            label = _label(case, baseline.name)
            if isinstance(runner, str):
                base_rows.append(BenchRow(op, case.describe(), label, "baseline", note=runner))
                continue
            timing = time_fn(runner, dev)
            row = _row(case, label, "baseline", timing.median_ms, ceil)
            row.note = "; ".join(filter(None, (_timing_note(timing, dev), getattr(runner, "note", ""))))
            base_rows.append(row)
        for row in kernel_rows:
            assert row.ms is not None  # kernel_rows are timed rows (_row)
            row.speedups = {b.impl: b.ms / row.ms for b in base_rows if b.ms is not None}
        report.rows += kernel_rows + base_rows
    progress.done()
    if not quiet:
        print(report.table(), file=stream or sys.stdout)
    if json_path is not None:
        write_json(json_path, report.to_json())
    return report
