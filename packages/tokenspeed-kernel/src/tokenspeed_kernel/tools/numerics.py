"""``check``: run kernels on fresh random inputs and compare with the float64 reference.

Two sources of cases. By default (``preset="derived"``) each kernel gets the cases derived
from its own registration (:mod:`.claims`): every listed dtype combination, each feature
alone and all together, each listed shape range at its edges, ragged batches with length-1
and padding rows; and the report ends with the claims coverage of each kernel. A named
preset (``awkward``, ``small``, ...) instead runs the same cases on every candidate, for
comparing kernels.

For every case and kernel, the public operator is called with ``override=<kernel>`` on
inputs drawn for that case, outputs poisoned with NaN first where the operator takes
``out=``, and the result is compared with the reference kernels run in float64
(:mod:`.tolerances`). A kernel that cannot serve a case (the selector rejects the override
on this device's platform) is reported as SKIP with the selector's reason; one that raises
is a FAIL with the exception, and the remaining kernels and cases still run. In derived mode
a kernel that cannot run on this platform at all (vendor, architecture, capabilities, a
missing library) is one SKIP row, "not run here", and its claims are ``not run here``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from tokenspeed_kernel import registry, selector
from tokenspeed_kernel.platform import platform_for
from tokenspeed_kernel.selector import KernelOverrideError
from tokenspeed_kernel.tools import cases, claims
from tokenspeed_kernel.tools.claims import ClaimRow
from tokenspeed_kernel.tools.common import kernels_per_op, provenance, resolve_device
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
    """The rows of a run; in derived mode also the seed, the claims coverage and one command
    line per failing (kernel, case) that reproduces it."""

    device: str
    rows: list[CheckRow] = field(default_factory=list)
    preset: str = claims.DERIVED
    seed: int = 0
    claims: list[ClaimRow] = field(default_factory=list)
    reproduce: list[str] = field(default_factory=list)

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

    @property
    def failed_claims(self) -> list[ClaimRow]:
        return [c for c in self.claims if c.status == "failed"]

    def to_json(self) -> dict[str, Any]:
        """The report as JSON values: the device, the versions and commit
        (:func:`.common.provenance`), the preset, the seed, ``ok``, the counts, every row (op,
        case, kernel, status PASS/FAIL/SKIP, ``passed``, errors, tolerances, reason), and in
        derived mode the claims (op, kernel, kind, claim, status, cases, note) with their
        counts per status and the reproducing command lines."""
        return {
            "device": self.device,
            **provenance(),
            "preset": self.preset,
            "seed": self.seed,
            "ok": self.ok,
            "passed": len(self.passed),
            "failed": len(self.failed),
            "skipped": len(self.rows) - len(self.passed) - len(self.failed),
            "rows": [{**dataclasses.asdict(r), "passed": r.passed} for r in self.rows],
            "claims": [dataclasses.asdict(c) for c in self.claims],
            "claim_counts": {s: sum(c.status == s for c in self.claims) for s in claims.STATUSES},
            "reproduce": list(self.reproduce),
        }

    def table(self) -> str:
        """Each row with its errors and the tolerance they were held to (``tol l2/abs``:
        the ``rel_l2`` bound and the ``max_abs`` bound in units of ``1 + max|ref|``)."""
        head = (
            f"{'status':<6} {'op':<18} {'kernel':<28} {'max_abs':>10} {'rel_l2':>10} {'max_rel':>10} "
            f"{'tol l2/abs':>13}  case"
        )
        derived = self.preset == claims.DERIVED
        first = f"device: {self.device}" + (
            f"  seed: {self.seed}  cases: derived from each kernel's registration" if derived else ""
        )
        lines = [first, head, "-" * len(head)]
        for r in self.rows:
            if r.status == "SKIP":
                nums = " " * 46
            else:
                tol = f"{r.tol_rel_l2:g}/{r.tol_max_abs:g}"
                nums = f"{r.max_abs:>10.3g} {r.rel_l2:>10.3g} {r.max_rel:>10.3g} {tol:>13}"
            tail = f"  ({r.reason})" if r.reason else ""
            lines.append(f"{r.status:<6} {r.op:<18} {r.kernel:<28} {nums}  {r.case}{tail}")
        lines.append("pass: no NaN, rel_l2 <= tol l2 and max_abs <= tol abs * (1 + max|ref|) (tools/tolerances.py)")
        summary = (
            f"{len(self.passed)} passed, {len(self.failed)} failed, "
            f"{len(self.rows) - len(self.passed) - len(self.failed)} skipped"
        )
        if derived:
            lines += ["", f"claims coverage (seed {self.seed}; {' / '.join(claims.STATUSES)}):"]
            lines += claims.render(self.claims)
            lines += [f"reproduce: {command}" for command in self.reproduce]
            counts = ", ".join(f"{sum(c.status == s for c in self.claims)} {s}" for s in claims.STATUSES)
            summary += f"; claims: {counts}"
        lines.append(summary)  # the summary stays the last line (scripts read it)
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
        assert ref[1] is not None  # moe.topk's reference returns (weights, ids)
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


def _candidates(ops: list[str], kernel: str | None) -> dict[str, list[str]]:
    """Per operator, the kernels to check: all registered, or the one named (on its own
    operator only when several are checked)."""
    if kernel is None:
        return {op: [spec.name for spec in registry.kernels(op)] for op in ops}
    return kernels_per_op(ops, [kernel])


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
        fresh = cases.fresh_copies(inputs)
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
        reason = "NaN in output" if verdict.has_nan else ""
        if verdict.passed:
            verdict, reason = _judge_plan(case, inputs, name, ref, device, verdict)
        rows.append(
            CheckRow(
                op,
                case.describe(),
                name,
                "PASS" if verdict.passed else "FAIL",
                verdict.max_abs,
                verdict.rel_l2,
                tol.describe(),
                reason,
                verdict.max_rel,
                tol.rel_l2,
                tol.max_abs,
            )
        )
    return rows


def _judge_plan(
    case: cases.Case, inputs: dict[str, Any], name: str, ref: tuple, device: torch.device, functional: Comparison
) -> tuple[Comparison, str]:
    """The verdict of kernel ``name`` through each per-step plan its hooks claim serves as the
    call does (:func:`cases.plan_paths`: a ``step_runner``, a decode plan's ``bind`` or
    ``prepare_layout``), on fresh copies into a poisoned output: ``functional`` and no reason
    when every plan passes (or the kernel has no such hook), else the first failing plan's
    comparison and the reason naming it."""
    spec = registry.get_kernel(name)
    for path in cases.plan_paths(case, spec):
        out = _poisoned_out(case, ref[0], device)
        try:
            result = cases.plan_call(case, cases.fresh_copies(inputs), name, out, path)
        except Exception as exc:
            first = str(exc).splitlines()[0][:120] if str(exc) else ""
            reason = f"through its {path} plan: raised {type(exc).__name__}: {first}"
            return dataclasses.replace(functional, passed=False), reason
        verdict = _judge(case, _outputs(case, result), ref)
        if not verdict.passed:
            return verdict, f"through its {path} plan: " + ("NaN in output" if verdict.has_nan else "out of tolerance")
    return functional, ""


def _check_derived(report: CheckReport, op: str, name: str, dev: torch.device, seed: int, case_id: str | None) -> None:
    """One kernel on the cases derived from its registration: its rows, claims and the
    command lines reproducing its failures, added to ``report``."""
    spec = registry.get_kernel(name)
    derivation = claims.derive(spec, dev.type, seed)
    chosen = derivation.cases if case_id is None else [derivation.case(case_id)]
    not_run = "; ".join(selector.platform_reasons(spec, platform_for(dev)))
    verdicts: dict[str, str] = {}
    if not_run:
        count = f"({len(chosen)} derived case{'s' if len(chosen) != 1 else ''})"
        report.rows.append(CheckRow(op, count, name, "SKIP", reason=f"not run here: {not_run}"))
    for derived in [] if not_run else chosen:
        (row,) = check_case(derived.case, [name], dev, seed + derived.index)
        report.rows.append(row)
        verdicts[derived.id] = row.status
        if row.status == "FAIL":
            report.reproduce.append(
                f"tokenspeed-kernel check {op} --kernel {name} --seed {seed} --case {derived.id} --device {dev.type}"
            )
    report.claims += claims.coverage(derivation, verdicts, not_run)


def check(
    ops: str | Iterable[str],
    *,
    kernel: str | None = None,
    preset: str = claims.DERIVED,
    device: str | torch.device | None = None,
    seed: int = 0,
    stream: TextIO | None = None,
    quiet: bool = False,
    case: str | None = None,
) -> CheckReport:
    """Check kernels of ``ops`` (a name, ``"all"`` or a list): on the cases derived from each
    kernel's registration (``preset="derived"``, the default; ``case`` runs one of them by
    id, with one ``kernel``) or on a preset's cases.

    Prints the table to ``stream`` (default: stdout) unless ``quiet`` and returns the report;
    ``report.ok`` is False on any failure (in derived mode: a failed claim) or when nothing
    could be checked. ``ValueError`` for an unknown preset, kernel or case id, and for
    ``case`` without ``kernel`` or with a preset.
    """
    op_list = list(cases.OPS) if ops == "all" else [ops] if isinstance(ops, str) else list(ops)
    for op in op_list:
        cases.module_for(op)  # an operator without cases is an error before anything runs
    derived = preset == claims.DERIVED
    if case is not None and (not derived or kernel is None):
        raise ValueError("--case ID picks one derived case of one kernel: give --kernel, and no --preset")
    if not derived:
        for op in op_list:
            preset_cases(preset, op)  # an unknown preset is an error before anything runs
    dev = resolve_device(device)
    selector.env_overrides()  # an invalid TOKENSPEED_KERNEL_OVERRIDE is an error here, not SKIP rows
    names_per_op = _candidates(op_list, kernel)  # every name checked before any run
    name = str(dev) if dev.type == "cpu" else f"{dev} ({torch.cuda.get_device_name(dev)})"
    report = CheckReport(name, preset=preset, seed=seed)
    for op in op_list:
        if derived:
            for kernel_name in names_per_op[op]:
                _check_derived(report, op, kernel_name, dev, seed, case)
            continue
        for index, preset_case in enumerate(preset_cases(preset, op)):
            report.rows += check_case(preset_case, names_per_op[op], dev, seed + index)
    if not quiet:
        print(report.table(), file=stream or sys.stdout)
    return report
