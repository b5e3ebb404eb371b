"""``check``: run kernels on fresh random inputs and compare with the float64 reference.

For every case of a preset and every candidate kernel (all registered for the operator, or
one named), the public operator is called with ``override=<kernel>`` on inputs drawn for
that case, outputs poisoned with NaN first where the operator takes ``out=``, and the
result is compared with the reference kernels run in float64 (:mod:`.tolerances`). A
kernel that cannot serve a case (the selector rejects the override on this device's
platform) is reported as SKIP with the selector's reason; one that raises is a FAIL with
the exception, and the remaining kernels and cases still run.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from tokenspeed_kernel import registry, selector
from tokenspeed_kernel.selector import KernelOverrideError
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.common import named_kernels, provenance, resolve_device
from tokenspeed_kernel.tools.presets import preset_cases
from tokenspeed_kernel.tools.tolerances import Comparison, compare, tolerance_for

__all__ = ["CheckReport", "CheckRow", "check", "check_case"]


@dataclass(frozen=True)
class CheckRow:
    """One kernel on one case: PASS, FAIL or SKIP (with the reason).

    ``max_abs``/``rel_l2``/``max_rel`` are the worst over the case's outputs (``out`` and
    ``lse``; the top-k weights; the two caches); ``tolerance`` says in words what they were
    held to, ``tol_rel_l2``/``tol_max_abs`` are the same bounds as numbers (``max_abs`` is
    held to ``tol_max_abs * (1 + max|ref|)``).
    """

    op: str
    case: str
    kernel: str
    status: str
    max_abs: float = float("nan")
    rel_l2: float = float("nan")
    tolerance: str = ""
    reason: str = ""
    max_rel: float = float("nan")
    tol_rel_l2: float = float("nan")
    tol_max_abs: float = float("nan")

    @property
    def passed(self) -> bool:
        return self.status == "PASS"


@dataclass
class CheckReport:
    device: str
    rows: list[CheckRow] = field(default_factory=list)

    @property
    def failed(self) -> list[CheckRow]:
        return [r for r in self.rows if r.status == "FAIL"]

    @property
    def passed(self) -> list[CheckRow]:
        return [r for r in self.rows if r.status == "PASS"]

    @property
    def ok(self) -> bool:
        """No failure, and at least one kernel actually checked."""
        return not self.failed and bool(self.passed)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON values: the device, the versions and commit
        (:func:`.common.provenance`), ``ok``, the counts and every row (op, case, kernel,
        status PASS/FAIL/SKIP, ``passed``, errors, tolerances, reason)."""
        return {
            "device": self.device,
            **provenance(),
            "ok": self.ok,
            "passed": len(self.passed),
            "failed": len(self.failed),
            "skipped": len(self.rows) - len(self.passed) - len(self.failed),
            "rows": [{**dataclasses.asdict(r), "passed": r.passed} for r in self.rows],
        }

    def table(self) -> str:
        """Each row with its errors and the tolerance they were held to (``tol l2/abs``:
        the ``rel_l2`` bound and the ``max_abs`` bound in units of ``1 + max|ref|``)."""
        head = (
            f"{'status':<6} {'op':<18} {'kernel':<28} {'max_abs':>10} {'rel_l2':>10} {'max_rel':>10} "
            f"{'tol l2/abs':>13}  case"
        )
        lines = [f"device: {self.device}", head, "-" * len(head)]
        for r in self.rows:
            if r.status == "SKIP":
                nums = " " * 46
            else:
                tol = f"{r.tol_rel_l2:g}/{r.tol_max_abs:g}"
                nums = f"{r.max_abs:>10.3g} {r.rel_l2:>10.3g} {r.max_rel:>10.3g} {tol:>13}"
            tail = f"  ({r.reason})" if r.reason else ""
            lines.append(f"{r.status:<6} {r.op:<18} {r.kernel:<28} {nums}  {r.case}{tail}")
        lines.append("pass: no NaN, rel_l2 <= tol l2 and max_abs <= tol abs * (1 + max|ref|) (tools/tolerances.py)")
        lines.append(  # the summary stays the last line (scripts read it)
            f"{len(self.passed)} passed, {len(self.failed)} failed, {len(self.rows) - len(self.passed) - len(self.failed)} skipped"
        )
        return "\n".join(lines)


def _poisoned_out(case: cases.Case, ref: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A NaN-filled output buffer for operators that take ``out=`` (None otherwise)."""
    if case.op in ("kvcache.store", "moe.topk"):
        return None
    return torch.full(ref.shape, float("nan"), dtype=case.dtype, device=device)


def _outputs(case: cases.Case, result: Any) -> list[torch.Tensor]:
    """The tensors a result is judged on, in the order :func:`cases.reference` returns them."""
    if case.op in ("kvcache.store", "moe.topk"):
        return list(result)
    if isinstance(result, tuple):
        return [result[0], result[1]]
    return [result]


def _judge(case: cases.Case, got: list[torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor | None]) -> Comparison:
    tol = tolerance_for(case)
    if case.op == "moe.topk":
        weights = compare(got[0], ref[0], tol)
        ids_ok = _ids_agree(got[1], ref[1], ref[0], tol.max_abs)
        return dataclasses.replace(weights, passed=weights.passed and ids_ok)
    results = [compare(g, r, tol) for g, r in zip(got, ref) if r is not None]
    return Comparison(
        max_abs=max(c.max_abs for c in results),
        rel_l2=max(c.rel_l2 for c in results),
        has_nan=any(c.has_nan for c in results),
        passed=all(c.passed for c in results),
        max_rel=max(c.max_rel for c in results),
    )


def _ids_agree(ids: torch.Tensor, ref_ids: torch.Tensor, ref_weights: torch.Tensor, tie: float) -> bool:
    """Expert ids must match, except among reference weights tied within ``tie``."""
    differ = ids.to(torch.int64) != ref_ids.to(torch.int64)
    if not differ.any():
        return True
    w = ref_weights.to(torch.float64)
    near_prev = torch.zeros_like(differ)
    near_prev[:, 1:] = (w[:, 1:] - w[:, :-1]).abs() <= tie
    near_next = torch.zeros_like(differ)
    near_next[:, :-1] = near_prev[:, 1:]
    return bool((~differ | near_prev | near_next).all())


def _candidates(op: str, kernel: str | None) -> list[str]:
    if kernel is not None:
        return named_kernels(op, [kernel])
    return [spec.name for spec in registry.kernels(op)]


def check_case(case: cases.Case, names: Iterable[str], device: torch.device, seed: int = 0) -> list[CheckRow]:
    """Check each kernel of ``names`` (registered for ``case.op``) on ``case``: inputs drawn
    with ``seed``, the float64 reference computed once, every kernel called on fresh copies
    with its output poisoned. One row per kernel: PASS, FAIL (numbers out of tolerance, NaN,
    or an exception) or SKIP (the selector's reason). :func:`check` runs this per case."""
    op = case.op
    rows: list[CheckRow] = []
    inputs = cases.make_inputs(case, device, seed)
    ref = cases.reference(case, inputs)
    tol = tolerance_for(case)
    for name in names:
        fresh = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        out = _poisoned_out(case, ref[0], device)
        try:
            result = cases.call(case, fresh, override=name, out=out)
        except KernelOverrideError as exc:
            reason = str(exc).split(": ", 1)[-1]
            rows.append(CheckRow(op, case.describe(), name, "SKIP", reason=reason))
            continue
        except Exception as exc:  # a crashing kernel is a failure of that row, not of the tool
            reason = f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            rows.append(
                CheckRow(
                    op,
                    case.describe(),
                    name,
                    "FAIL",
                    tolerance=tol.describe(),
                    reason=reason,
                    tol_rel_l2=tol.rel_l2,
                    tol_max_abs=tol.max_abs,
                )
            )
            continue
        verdict = _judge(case, _outputs(case, result), ref)
        rows.append(
            CheckRow(
                op,
                case.describe(),
                name,
                "PASS" if verdict.passed else "FAIL",
                verdict.max_abs,
                verdict.rel_l2,
                tol.describe(),
                "NaN in output" if verdict.has_nan else "",
                verdict.max_rel,
                tol.rel_l2,
                tol.max_abs,
            )
        )
    return rows


def check(
    ops: str | Iterable[str],
    *,
    kernel: str | None = None,
    preset: str = "awkward",
    device: str | torch.device | None = None,
    seed: int = 0,
    stream: TextIO | None = None,
    quiet: bool = False,
) -> CheckReport:
    """Check kernels of ``ops`` (a name, ``"all"`` or a list) on ``preset``'s cases.

    Prints the table to ``stream`` (default: stdout) unless ``quiet`` and returns the report;
    ``report.ok`` is False on any failure or when nothing could be checked.
    """
    op_list = list(cases.OPS) if ops == "all" else [ops] if isinstance(ops, str) else list(ops)
    dev = resolve_device(device)
    selector.env_overrides()  # an invalid TOKENSPEED_KERNEL_OVERRIDE is an error here, not SKIP rows
    names_per_op = {op: _candidates(op, kernel) for op in op_list}  # every name checked before any run
    report = CheckReport(str(dev) if dev.type == "cpu" else f"{dev} ({torch.cuda.get_device_name(dev)})")
    for op in op_list:
        for index, case in enumerate(preset_cases(preset, op)):
            report.rows += check_case(case, names_per_op[op], dev, seed + index)
    if not quiet:
        print(report.table(), file=stream or sys.stdout)
    return report
