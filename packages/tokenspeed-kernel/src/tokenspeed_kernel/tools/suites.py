"""Named benchmark suites (``tokenspeed-kernel bench --suite NAME``): one command for a table.

A suite is data (:class:`Suite`): entries, each an operator, the named cases of a preset it
times, which kernels (:data:`KERNEL_SETS` or names) and whether the torch baselines run too.
A run goes case by case. For each case the kernels are first checked against the float64
reference (:func:`.numerics.check_case`, what ``check`` runs); those that pass are timed
with the baselines on the same inputs in the same process (:func:`.bench.bench`, what
``bench`` runs); the selector's pick is then set against every other timed row
(``peer time / pick time``, above 1: the pick is faster).

Kernel sets: ``pick`` is the selector's choice only; ``peers`` is the pick and every other
kernel the selector accepts for the case on this platform, the reference kernels left out
(they are the float64 oracle's code, not competitors; they run when they are the pick), so
a vendor wheel's kernels join when the wheel and its libraries are installed; ``all`` is
every registered kernel (those that cannot serve the case are listed as SKIP with the
selector's reason).

A suite with ``end_to_end`` ends with the section "end to end": the example decoder
(``examples/gpt_oss``, GPT-OSS-120B widths, 2 layers) timed by ``examples.gpt_oss.bench``
(its ``suite_config``: decode and prefill tokens/s of the selector's kernels against the
plain-PyTorch path of the same model, and eager against CUDA-graph decode at B = 1), one row
per point. The examples are in no wheel: the section runs where that module imports (from
the repository root), else the table's "left out" says why. Its check is not float64: finite
logits, and the library path's logits against the plain-PyTorch path's on the same inputs
(``examples.gpt_oss.bench.CHECK``); the model's float64 check is tests/examples. With a
``preset`` override it runs the example's tiny model.

``budget_s`` bounds the run: a case starts only while the time left exceeds the longest case
of its operator so far (of any operator before the first), so the run ends inside a device
call's time limit; cases not started are rows marked ``not run (budget)``. The end-to-end
section starts under the same rule (the longest case of any operator), then gets the time
left, and inside it a measurement starts only while the time left exceeds its longest so
far. The JSON file is rewritten after every case, so a run killed from outside still leaves
what it measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from tokenspeed_kernel import registry, selector
from tokenspeed_kernel.platform import platform_for
from tokenspeed_kernel.registry import Priority
from tokenspeed_kernel.tools import cases, presets
from tokenspeed_kernel.tools.ceilings import Ceilings
from tokenspeed_kernel.tools.common import PROVENANCE_KEYS, named_kernels, provenance, resolve_device, write_json
from tokenspeed_kernel.tools.numerics import CheckRow, check_case
from tokenspeed_kernel.tools.progress import Progress

__all__ = [
    "E2E_LABEL",
    "KERNEL_SETS",
    "NOT_RUN_BUDGET",
    "PLOT_INSTALL",
    "SUITES",
    "Suite",
    "SuiteEntry",
    "SuiteReport",
    "SuiteRow",
    "plot",
    "run_suite",
    "validate_suite",
]

KERNEL_SETS = ("pick", "peers", "all")
NOT_RUN_BUDGET = "not run (budget)"
PLOT_INSTALL = "pip install 'tokenspeed-kernel[plot]'"
E2E_LABEL = "end to end"
_E2E_MODULE = "examples.gpt_oss.bench"
_E2E_ABSENT = (
    "end to end, 2-layer decoder: run from the repository root: examples/gpt_oss is not in the installed package"
)


@dataclass(frozen=True)
class SuiteEntry:
    """One group of rows: ``op``'s cases of ``preset`` named in ``cases`` (all of the
    preset's cases for ``op`` when empty), the kernels to time (``pick``, ``peers``, ``all``
    or comma-separated kernel names registered for ``op``), and whether the torch baselines
    of :mod:`.baselines` are timed beside them."""

    label: str
    op: str
    preset: str
    cases: tuple[str, ...] = ()
    kernels: str = "peers"
    baselines: bool = True


@dataclass(frozen=True)
class Suite:
    """A named list of entries; ``left_out`` says which published figures it does not
    reproduce, and why (each a line); ``end_to_end``: the section "end to end" (the example
    decoder, see the module docstring) follows the entries."""

    name: str
    description: str
    entries: tuple[SuiteEntry, ...]
    left_out: tuple[str, ...] = ()
    end_to_end: bool = False


_T = (1, 8, 64, 512, 4096)
_GPT_OSS = "gpt-oss-120b"

SUITES: dict[str, Suite] = {
    "gpt-oss-120b-h100": Suite(
        "gpt-oss-120b-h100",
        "the rows of docs/benchmarks.md: GPT-OSS-120B attention (64/8 heads of dim 64, bf16, "
        "page 16, sinks) full and with the 128-token window, MoE (128 experts top-4, H = I = 2880) "
        "with MXFP4 and bf16 weights, and the 2-layer example decoder end to end",
        (
            SuiteEntry(
                "decode",
                "attention.decode",
                _GPT_OSS,
                ("decode_b1_ctx8192", "decode_b8_ctx8192", "decode_b64_ctx8192", "decode_b256_ctx2048"),
            ),
            SuiteEntry(
                "decode window 128",
                "attention.decode",
                _GPT_OSS,
                (
                    "decode_b1_ctx8192_win128",
                    "decode_b8_ctx8192_win128",
                    "decode_b64_ctx8192_win128",
                    "decode_b256_ctx2048_win128",
                ),
            ),
            SuiteEntry("prefill", "attention.prefill", _GPT_OSS, ("prefill_b1_s8192",)),
            SuiteEntry(
                "prefill window 128",
                "attention.prefill",
                _GPT_OSS,
                ("prefill_b1_s8192_win128", "prefill_b4_s4096_win128"),
            ),
            SuiteEntry("extend", "attention.extend", _GPT_OSS, ("extend_2048_on_6144",)),
            SuiteEntry("MoE MXFP4", "moe.apply", _GPT_OSS, tuple(f"gpt_oss_120b_t{t}" for t in _T)),
            SuiteEntry("MoE bf16", "moe.apply", _GPT_OSS, tuple(f"gpt_oss_120b_t{t}_bf16" for t in _T)),
        ),
        (
            "MoE decode with routing included: a pipeline of two operators (moe_topk, then the "
            "expert computation), timed by a device script, not one operator's row",
            "vLLM and transformers rows: they need those engines installed",
            "host cost per eager call: `tokenspeed-kernel overhead --device cuda`",
        ),
        end_to_end=True,
    ),
}


def _entry_cases(entry: SuiteEntry, preset: str | None = None) -> list[cases.Case]:
    """The entry's cases; with ``preset`` (an override, e.g. ``small`` on a CPU) the entry's
    named cases found in that preset, else all of that preset's cases for the operator."""
    found = presets.preset_cases(preset or entry.preset, entry.op)
    if not entry.cases:
        return found
    named = {case.name: case for case in found}
    picked = [named[name] for name in entry.cases if name in named]
    if preset is not None:
        return picked or found
    missing = [name for name in entry.cases if name not in named]
    if missing:
        raise ValueError(f"entry {entry.label!r}: preset {entry.preset!r} has no {entry.op} cases named {missing}")
    return picked


def validate_suite(suite: Suite) -> None:
    """Raise ``ValueError`` (one line) unless every entry names a known operator and preset,
    cases that preset has, and a kernel set or kernels registered for its operator."""
    if not suite.entries and not suite.end_to_end:
        raise ValueError(f"suite {suite.name!r} has no entries")
    labels = [entry.label for entry in suite.entries]
    if len(set(labels)) != len(labels):
        raise ValueError(f"suite {suite.name!r}: entry labels must be unique, got {labels}")
    for entry in suite.entries:
        cases.module_for(entry.op)
        _entry_cases(entry)
        if entry.kernels not in KERNEL_SETS:
            named_kernels(entry.op, _names(entry.kernels))


def _names(kernels: str) -> list[str]:
    return [name.strip() for name in kernels.split(",") if name.strip()]


def _suite(name: str) -> Suite:
    try:
        return SUITES[name]
    except KeyError:
        raise ValueError(f"unknown suite {name!r}; known suites: {', '.join(SUITES)}") from None


@dataclass
class SuiteRow:
    """One case of one entry: the pick, every kernel's check, the timed rows (kernels that
    passed, then the baselines; bench's :class:`~.bench.BenchRow` fields as dicts, each
    kernel's with its ``check`` status), and the pick's speedup over each other timed row."""

    entry: str
    op: str
    case: str
    describe: str
    status: str = "run"
    pick: str | None = None
    check: list[CheckRow] = field(default_factory=list)
    timings: list[dict[str, Any]] = field(default_factory=list)
    speedups: dict[str, float] = field(default_factory=dict)
    not_accepted: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def failed(self) -> list[CheckRow]:
        return [row for row in self.check if row.status == "FAIL"]

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["check"] = [{**dataclasses.asdict(row), "passed": row.passed} for row in self.check]
        return data


@dataclass
class SuiteReport:
    """A suite run: where and with what it ran (``provenance``: :func:`.common.provenance`,
    read when the run starts), and one :class:`SuiteRow` per case. ``left_out``: the suite's
    lines, and why the end-to-end section did not run when it could not; ``end_to_end``: that
    section's kernels per row, check, goals and configuration (``E2EReport.to_json`` without
    its rows, which are :class:`SuiteRow` here), when it ran."""

    suite: Suite
    device: str
    provenance: dict[str, Any]
    date: str
    started: str
    preset: str | None = None
    kernels: str | None = None
    budget_s: float | None = None
    ceilings: Ceilings | None = None
    rows: list[SuiteRow] = field(default_factory=list)
    elapsed_s: float = 0.0
    left_out: list[str] = field(default_factory=list)
    end_to_end: dict[str, Any] | None = None

    @property
    def not_run(self) -> list[SuiteRow]:
        return [row for row in self.rows if row.status == NOT_RUN_BUDGET]

    @property
    def ok(self) -> bool:
        """No kernel failed the check and no case raised (cases the budget left out are fine)."""
        return not any(row.failed or row.status.startswith("error") for row in self.rows)

    def to_json(self) -> dict[str, Any]:
        return {
            "suite": self.suite.name,
            "description": self.suite.description,
            "device": self.device,
            **self.provenance,
            "date": self.date,
            "started": self.started,
            "preset": self.preset,
            "kernels": self.kernels,
            "budget_s": self.budget_s,
            "stopped_by_budget": bool(self.not_run),
            "not_run": [f"{row.entry}: {row.case}" for row in self.not_run],
            "elapsed_s": self.elapsed_s,
            "ok": self.ok,
            "ceilings": dataclasses.asdict(self.ceilings) if self.ceilings else None,
            "entries": [dataclasses.asdict(entry) for entry in self.suite.entries],
            "left_out": list(self.left_out),
            "end_to_end": self.end_to_end,
            "rows": [row.to_json() for row in self.rows],
        }

    def table(self) -> str:
        versions = ", ".join(f"{name} {version}" for name, version in self.provenance.get("versions", {}).items())
        commit = self.provenance.get("commit") or "unknown"
        lines = [
            f"suite {self.suite.name}: {self.suite.description}",
            f"device: {self.device}  {self.date}  commit {commit}{' (dirty)' if self.provenance.get('dirty') else ''}"
            + (f"  preset override {self.preset}" if self.preset else ""),
            f"versions: {versions}",
        ]
        if self.ceilings:
            c = self.ceilings
            lines.append(
                f"ceilings: copy {c.copy_tb_s:.2f} TB/s, bf16 matmul {c.matmul_tflop_s:.0f} TFLOP/s (measured)"
            )
        for label, grouped in itertools.groupby(self.rows, key=lambda row: row.entry):
            rows = list(grouped)
            if label == E2E_LABEL and self.end_to_end is not None:
                lines += ["", *_e2e_head(self.end_to_end)]
            else:
                lines += ["", f"== {label}: {rows[0].op}"]
            for row in rows:
                lines += _row_lines(row)
        lines += ["", "summary (peer time / pick time; above 1: the pick is faster)"]
        for row in self.rows:
            lines.append(_summary_line(row))
        if self.end_to_end is not None and self.end_to_end.get("goals"):
            lines += ["", "end-to-end goals:"] + [f"  - {goal}" for goal in self.end_to_end["goals"]]
        if self.left_out:
            lines += ["", "left out of this suite:"] + [f"  - {why}" for why in self.left_out]
        failed = sum(len(row.failed) for row in self.rows)
        done = sum(row.status == "run" for row in self.rows)
        lines.append(
            f"{done} of {len(self.rows)} cases run, {len(self.not_run)} {NOT_RUN_BUDGET}, "
            f"{failed} kernel checks failed, {self.elapsed_s:.0f} s"
        )
        return "\n".join(lines)


_HEAD = (
    f"    {'check':<5} {'rel_l2':>9}  {'impl':<32} {'ms':>9} {'TFLOP/s':>8} {'TB/s':>7} {'%copy':>6} {'%mma':>5}"
    "  pick speedup"
)


def _row_lines(row: SuiteRow) -> list[str]:
    lines = [row.describe]
    if row.status != "run":
        return [*lines, f"    {row.status}"]
    if row.op.startswith("e2e."):
        return lines + _e2e_lines(row)
    lines.append(_HEAD)
    checks = {c.kernel: c for c in row.check}
    timed = {t["impl"] for t in row.timings}
    for t in row.timings:
        c = checks.get(t["impl"])
        status = c.status if c else "-"
        err = f"{c.rel_l2:>9.2e}" if c and c.status != "SKIP" else f"{'':>9}"
        mark = "*" if t["impl"] == row.pick else " "
        if t["ms"] is None:
            lines.append(f"  {mark} {status:<5} {err}  {t['impl']:<32} {'-':>9}  {t['note']}")
            continue
        pct_c = f"{t['pct_copy']:>5.0f}%" if t["pct_copy"] is not None else f"{'':>6}"
        pct_m = f"{t['pct_matmul']:>4.0f}%" if t["pct_matmul"] is not None else f"{'':>5}"
        ratio = f"{row.speedups[t['impl']]:.2f}x" if t["impl"] in row.speedups else "-"
        note = f"  [{t['note']}]" if t["note"] else ""
        lines.append(
            f"  {mark} {status:<5} {err}  {t['impl']:<32} {t['ms']:>9.4f} {t['tflops'] or 0:>8.1f} "
            f"{t['tbps'] or 0:>7.3f} {pct_c} {pct_m}  {ratio}{note}"
        )
    for c in row.check:
        if c.kernel not in timed:
            why = "failed the check" if c.status == "FAIL" else "cannot serve it here"
            mark = "*" if c.kernel == row.pick else " "
            err = f"{c.rel_l2:>9.2e}" if c.status != "SKIP" else f"{'':>9}"
            lines.append(f"  {mark} {c.status:<5} {err}  {c.kernel:<32} {'-':>9}  not timed: {why} ({c.reason})")
    if row.not_accepted:
        lines.append(f"    not accepted here: {', '.join(row.not_accepted)}")
    return lines


def _summary_line(row: SuiteRow) -> str:
    head = f"  {row.entry:<20} {row.case:<28}"
    if row.status != "run":
        return f"{head} {row.status}"
    pick = next((t for t in row.timings if t["impl"] == row.pick and t["ms"] is not None), None)
    if pick is None:
        return f"{head} {row.pick or '?'}: not timed"
    peers = ", ".join(f"{impl} {ratio:.2f}x" for impl, ratio in row.speedups.items())
    return f"{head} {row.pick} {pick['ms']:.4f} ms  {peers or '(no peer timed)'}"


# ----------------------------------------------------------------------------- end to end

_E2E_HEAD = f"    {'check':<5} {'rel_l2':>9}  {'impl':<32} {'ms':>9} {'tok/s':>10}  pick speedup"


def _e2e_head(meta: dict[str, Any]) -> list[str]:
    model = meta["model"]
    lines = [
        f"== {E2E_LABEL}: examples/gpt_oss, {model['num_layers']} layers at hidden {model['hidden_size']}, "
        f"vocab {model['vocab_size']}, page {meta['config']['page_size']}; the library path against the "
        "plain-PyTorch path of the same model, same run",
        f"   check: {meta['check']}",
    ]
    lines += [f"   {row:<9} {used}" for row, used in meta["kernels"].items()]
    return lines + [f"   skipped: {why}" for why in meta["skipped"]]


def _e2e_lines(row: SuiteRow) -> list[str]:
    """An end-to-end row: each timed path (the ``rel_l2`` column: the median over sequences
    against the plain-PyTorch path), then the pick's speedups."""
    lines = [_E2E_HEAD]
    checks = {c.kernel: c for c in row.check}
    for t in row.timings:
        c = checks.get(t["impl"])
        status = c.status if c else ""
        err = f"{c.rel_l2:>9.2e}" if c and c.rel_l2 == c.rel_l2 else f"{'':>9}"
        mark = "*" if t["impl"] == row.pick else " "
        if t["ms"] is None:
            lines.append(f"  {mark} {status:<5} {err}  {t['impl']:<32} {'-':>9}  {t['note']}")
            continue
        ratio = f"{row.speedups[t['impl']]:.2f}x" if t["impl"] in row.speedups else "-"
        lines.append(
            f"  {mark} {status:<5} {err}  {t['impl']:<32} {t['ms']:>9.4f} {t['tok_s']:>10.0f}  {ratio}  [{t['note']}]"
        )
    lines += [f"    {c.kernel}: {c.status}: {c.reason}" for c in row.check if c.status == "FAIL"]
    return lines


def _e2e_module() -> tuple[Any, str | None]:
    """(``examples.gpt_oss.bench``, None), or (None, why not). The examples are in no wheel:
    the module is imported from ``sys.path``, else from the current directory when that is
    the repository root (a console script's ``sys.path`` lacks it; appended, so installed
    packages keep precedence)."""
    root = os.getcwd()
    if os.path.isfile(os.path.join(root, "examples", "gpt_oss", "bench.py")) and root not in sys.path:
        sys.path.append(root)
    try:
        return importlib.import_module(_E2E_MODULE), None
    except ImportError as exc:
        return None, f"{_E2E_ABSENT} ({type(exc).__name__}: {exc})"


def _e2e_describe(meta: dict[str, Any], what: str, batch: int, ctx: int, device: torch.device) -> str:
    model = meta["model"]
    where = f"{model['num_layers']} layers, hidden {model['hidden_size']}, vocab {model['vocab_size']}"
    if what == "decode":
        how = "CUDA graph replay" if device.type == "cuda" else "eager"
        return f"decode step: {batch} sequence(s) at {ctx} tokens ({where}); {how}, tokens/s = {batch} / step"
    return f"prefill forward: {batch} prompt(s) of {ctx} tokens ({where}); eager, last-token logits"


def _e2e_timing(
    op: str, case: str, impl: str, kind: str, ms: float | None, tok_s: float | None, note: str
) -> dict[str, Any]:
    """A timing in the keys of ``bench``'s rows (``BenchRow``), with ``tok_s``."""
    return {
        "op": op,
        "case": case,
        "impl": impl,
        "kind": kind,
        "ms": ms,
        "tflops": None,
        "tbps": None,
        "pct_copy": None,
        "pct_matmul": None,
        "selected": False,
        "speedups": {},
        "note": note,
        "relayout_ms": None,
        "tok_s": tok_s,
    }


def _e2e_rows(result: Any, device: torch.device) -> list[SuiteRow]:
    """One :class:`SuiteRow` per point of an ``E2EReport``: the pick is the ``selector`` row;
    timed are every row's step (graph replay where captured) and, where also measured, its
    eager step (``ROW eager``); speedups are peer ms / pick ms (``selector eager``: issue 19's
    eager/graph ratio)."""
    meta = {k: v for k, v in result.to_json().items() if k != "rows"}
    names = [r for r in result.config.rows if r != "torch"]
    pick = "selector" if "selector" in names else (names[0] if names else "torch")
    skipped = {why.split(": ", 1)[0]: why.split(": ", 1)[1] for why in result.skipped}
    out = []
    for point in result.config.points:
        op, case = f"e2e.{point.what}", point.label
        what, batch, ctx = point
        row = SuiteRow(E2E_LABEL, op, case, _e2e_describe(meta, what, batch, ctx, device), pick=pick)
        got = [r for r in result.rows if r.point == point]
        mine = next((r for r in got if r.row == pick), None)
        if not got or mine is None:
            row.status = f"not run: {skipped.get(case, 'the row could not be built')}"
            out.append(row)
            continue
        if mine.status != "run":
            budget = mine.status == "skipped: time budget"
            row.status = NOT_RUN_BUDGET if budget else mine.status
            out.append(row)
            continue
        for r in got:
            kind = "baseline" if r.row == "torch" else "model"
            if r.status != "run":
                row.timings.append(_e2e_timing(op, case, r.row, kind, None, None, r.status))
                continue
            how = "CUDA graph replay" if r.graph_ms is not None else "eager"
            row.timings.append(
                _e2e_timing(op, case, r.row, kind, r.ms, r.tok_s, how + (f"; {r.note}" if r.note else ""))
            )
            if r.graph_ms is not None and r.eager_ms is not None:
                tok = r.tok_s * r.ms / r.eager_ms
                row.timings.append(
                    _e2e_timing(op, case, f"{r.row} eager", kind, r.eager_ms, tok, "eager, no CUDA graph")
                )
            row.check.append(
                CheckRow(
                    op,
                    case,
                    r.row,
                    r.check if r.check in ("PASS", "FAIL") else "SKIP",
                    rel_l2=r.rel_l2_median if r.rel_l2_median is not None else float("nan"),
                    max_rel=r.rel_l2_max if r.rel_l2_max is not None else float("nan"),
                    tolerance=meta["check"],
                    reason=r.check_note,
                )
            )
        for t in row.timings:
            t["selected"] = t["impl"] == pick
            t["check"] = next((c.status for c in row.check if c.kernel == t["impl"]), None)
        row.speedups = {t["impl"]: t["ms"] / mine.ms for t in row.timings if t["ms"] and t["impl"] != pick}
        out.append(row)
    return out


def _run_end_to_end(
    module: Any,
    report: SuiteReport,
    dev: torch.device,
    *,
    tiny: bool,
    left: float | None,
    progress: Progress,
    clock: Callable[[], float],
) -> None:
    """The section "end to end" into ``report``: ``module.measure`` of its ``suite_config``
    within ``left`` seconds (None: no limit); a failure to set it up is one ``error`` row."""
    config = module.suite_config(tiny=tiny)
    begin = clock()
    try:
        result = module.measure(
            dev,
            config,
            budget_s=left,
            log=progress.note,
            on_point=lambda point: progress.step(f"{E2E_LABEL}: {point.label}"),
            clock=clock,
        )
    except Exception as exc:  # building the model (e.g. out of memory): the kernel rows stay
        why = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        report.rows.append(SuiteRow(E2E_LABEL, "e2e", "setup", "the example decoder", why, seconds=clock() - begin))
        return
    report.end_to_end = {k: v for k, v in result.to_json().items() if k != "rows"}
    rows = _e2e_rows(result, dev)
    for row in rows:
        row.seconds = result.elapsed_s / len(rows)
    report.rows += rows


def _kernel_set(
    case: cases.Case, which: str, device: torch.device | None = None
) -> tuple[str | None, list[str], dict[str, str]]:
    """(the selector's pick, the kernels to check and time, kernels the selector does not
    accept here with their reasons) for ``case`` and a kernel set or names, on the platform
    of ``device`` (``--device cpu`` on a GPU machine selects for the CPU; None: the current)."""
    where = platform_for(device) if device is not None else None
    selection = selector.explain(cases.request(case), platform=where)
    pick = selection.winner.name if selection.winner is not None else None
    rejected = {c.spec.name: "; ".join(c.reasons) for c in selection.candidates if not c.accepted}
    if which == "all":
        names = [spec.name for spec in registry.kernels(case.op)]
    elif which == "pick":
        names = [pick] if pick else []
    elif which == "peers":
        others = [
            c.spec.name
            for c in selection.candidates
            if c.accepted and c.spec.name != pick and c.spec.band != Priority.REFERENCE
        ]
        names = ([pick] if pick else []) + others
    else:
        names = _names(which)
    return pick, names, rejected


@contextlib.contextmanager
def _one_case_preset(case: cases.Case) -> Iterator[str]:
    """A private preset holding only ``case`` (``PRESETS`` is open to sweeps of one's own),
    so ``bench`` times exactly this case; removed on exit."""
    key = f"_suite_case_{id(case)}"
    presets.PRESETS[key] = lambda op: [case] if op == case.op else []
    try:
        yield key
    finally:
        del presets.PRESETS[key]


def _run_case(
    entry: SuiteEntry, case: cases.Case, which: str, dev: torch.device, baselines: bool
) -> tuple[SuiteRow, Ceilings | None]:
    from tokenspeed_kernel.tools.bench import bench  # the bench module imports the timing stack

    row = SuiteRow(entry.label, case.op, case.name or case.describe(), case.describe())
    row.pick, names, rejected = _kernel_set(case, which, dev)
    row.not_accepted = {name: why for name, why in rejected.items() if which != "all" and name not in names}
    if row.pick is None and not names:
        row.status = "no kernel can serve it"
        return row, None
    row.check = check_case(case, names, dev, seed=0)
    passed = [c.kernel for c in row.check if c.passed]
    if not passed:
        return row, None
    with _one_case_preset(case) as key:
        report = bench(
            case.op,
            kernel=",".join(passed),
            preset=key,
            baselines=baselines and entry.baselines,
            device=dev,
            quiet=True,
        )
    status = {c.kernel: c.status for c in row.check}
    row.timings = [{**dataclasses.asdict(t), "check": status.get(t.impl)} for t in report.rows]
    pick_ms = next((t.ms for t in report.rows if t.impl == row.pick and t.kind == "kernel"), None)
    if pick_ms:
        row.speedups = {t.impl: t.ms / pick_ms for t in report.rows if t.ms is not None and t.impl != row.pick}
    return row, report.ceilings


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend; ``ValueError`` (one line, how to install
    it) when matplotlib is missing: it is an optional extra."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError(f"--plot needs matplotlib, which is not installed: {PLOT_INSTALL}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(report: SuiteReport, path: str) -> None:
    """A bar chart per entry: for each case, the pick's speedup over each peer (``peer time /
    pick time``; the line at 1 is parity), written to ``path`` (the format from its suffix)."""
    plt = _pyplot()
    groups = []
    for label, grouped in itertools.groupby(report.rows, key=lambda row: row.entry):
        timed = [row for row in grouped if row.speedups]
        if timed:
            groups.append((label, timed))
    fig, axes = plt.subplots(max(1, len(groups)), 1, figsize=(11, 3.2 * max(1, len(groups))), squeeze=False)
    if not groups:
        axes[0][0].text(0.5, 0.5, "no case was timed against a peer", ha="center", va="center")
    for (label, rows), ax_row in zip(groups, axes):
        ax = ax_row[0]
        peers = list(dict.fromkeys(peer for row in rows for peer in row.speedups))
        width = min(0.8 / len(peers), 0.3)
        for j, peer in enumerate(peers):
            at = [(i, row.speedups[peer]) for i, row in enumerate(rows) if peer in row.speedups]
            offset = (j - (len(peers) - 1) / 2) * width
            bars = ax.bar([i + offset for i, _ in at], [ratio for _, ratio in at], width, label=peer)
            ax.bar_label(bars, fmt="%.2f", fontsize=6)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xlim(-0.6, len(rows) - 0.4)
        ax.set_xticks(list(range(len(rows))))
        ax.set_xticklabels([f"{row.case}\n({row.pick})" for row in rows], fontsize=7)
        ax.set_ylabel("peer time / pick time")
        ax.set_title(f"{label}: the pick's speedup over each peer", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"{report.suite.name} on {report.device}, {report.date}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))  # room for the title above the charts
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_json(json_path: str, path: str) -> None:
    """Draw the chart of a saved run (the ``--json`` of ``bench --suite``) to ``path``: a run
    on a machine without matplotlib is plotted elsewhere, with no case run again."""
    _pyplot()  # the one-line error first when matplotlib is missing
    try:
        with open(json_path) as f:
            data = json.load(f)
        entries = tuple(SuiteEntry(**{**e, "cases": tuple(e["cases"])}) for e in data["entries"])
        suite = Suite(data["suite"], data["description"], entries, tuple(data["left_out"]))
        rows = [
            SuiteRow(r["entry"], r["op"], r["case"], r["describe"], r["status"], r["pick"], speedups=r["speedups"])
            for r in data["rows"]
        ]
        kept = {key: data.get(key) for key in PROVENANCE_KEYS}
        report = SuiteReport(suite, data["device"], kept, data["date"], data["started"], rows=rows)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--from-json {json_path}: not a saved suite run ({type(exc).__name__}: {exc})") from None
    plot(report, path)


def run_suite(
    name: str,
    *,
    device: str | torch.device | None = None,
    preset: str | None = None,
    kernels: str | None = None,
    baselines: bool = True,
    budget_s: float | None = None,
    json_path: str | None = None,
    plot_path: str | None = None,
    stream: TextIO | None = None,
    quiet: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> SuiteReport:
    """Run suite ``name`` (see the module docstring); print its table unless ``quiet``.

    ``preset`` replaces every entry's preset (``small`` runs the suite's structure at tiny
    shapes, on a CPU too); ``kernels`` (``pick``, ``peers``, ``all``) replaces every entry's
    kernel set. Every argument is checked before anything runs (``ValueError``, one line):
    the suite, the device, the preset, the kernel set, the budget, and matplotlib when
    ``plot_path`` is given.
    """
    started = clock()
    suite = _suite(name)
    validate_suite(suite)
    dev = resolve_device(device)
    selector.env_overrides()
    if kernels is not None and kernels not in KERNEL_SETS:
        raise ValueError(f"with a suite, the kernels are one of {', '.join(KERNEL_SETS)}; got {kernels!r}")
    if budget_s is not None and not budget_s >= 0:
        raise ValueError(f"the budget must be a number of seconds >= 0, got {budget_s}")
    if plot_path is not None:
        _pyplot()
    work = [(entry, case) for entry in suite.entries for case in _entry_cases(entry, preset)]
    e2e, why_not = _e2e_module() if suite.end_to_end else (None, None)
    e2e_points = e2e.suite_config(tiny=preset is not None).points if e2e is not None else ()
    now = datetime.datetime.now(datetime.timezone.utc)
    report = SuiteReport(
        suite,
        torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        provenance(),
        now.date().isoformat(),
        now.isoformat(timespec="seconds"),
        preset,
        kernels,
        budget_s,
        left_out=[*suite.left_out, *([why_not] if why_not else [])],
    )
    progress = Progress(len(work) + len(e2e_points), stream=sys.stderr)
    longest: dict[str | None, float] = {None: 0.0}
    for entry, case in work:
        name = case.name or case.describe()
        left = None if budget_s is None else budget_s - (clock() - started)
        progress.step(f"{entry.label}: {name}")
        if left is not None and (left <= 0 or left < longest.get(case.op, longest[None])):
            report.rows.append(SuiteRow(entry.label, case.op, name, case.describe(), NOT_RUN_BUDGET))
            progress.note(NOT_RUN_BUDGET)
            continue
        begin = clock()
        try:
            row, ceil = _run_case(entry, case, kernels or entry.kernels, dev, baselines)
        except Exception as exc:  # one case's crash (e.g. out of memory) must not lose the others
            why = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            row, ceil = SuiteRow(entry.label, case.op, name, case.describe(), why), None
        row.seconds = clock() - begin
        longest[case.op] = max(longest.get(case.op, 0.0), row.seconds)
        longest[None] = max(longest[None], row.seconds)
        report.ceilings = report.ceilings or ceil
        report.rows.append(row)
        progress.note(f"{row.status} ({row.seconds:.1f} s)")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        report.elapsed_s = clock() - started
        if json_path is not None:
            write_json(json_path, report.to_json())
    if e2e is not None:
        left = None if budget_s is None else budget_s - (clock() - started)
        if left is not None and (left <= 0 or left < longest[None]):
            for point in e2e_points:
                progress.step(f"{E2E_LABEL}: {point.label}")
                progress.note(NOT_RUN_BUDGET)
                what = f"the example decoder end to end: {point.label}"
                report.rows.append(SuiteRow(E2E_LABEL, f"e2e.{point.what}", point.label, what, NOT_RUN_BUDGET))
        else:
            _run_end_to_end(e2e, report, dev, tiny=preset is not None, left=left, progress=progress, clock=clock)
    progress.done()
    report.elapsed_s = clock() - started
    if json_path is not None:
        write_json(json_path, report.to_json())
    if not quiet:
        print(report.table(), file=stream or sys.stdout)
    if plot_path is not None:
        plot(report, plot_path)
    return report


def run_cli(args: Any) -> int:
    """``tokenspeed-kernel bench --suite NAME ...``: 0 when every kernel checked passed, 1 when
    one failed the float64 check or a case raised; rows the budget left out are not failures."""
    if args.op is not None:
        raise ValueError(f"give an operator or --suite, not both (got {args.op!r} and --suite {args.suite})")
    if args.replay is not None:
        raise ValueError("--replay and --suite cannot be combined")
    report = run_suite(
        args.suite,
        device=args.device,
        preset=args.preset,
        kernels=args.kernel,
        baselines=not args.no_baselines,
        budget_s=args.budget_s,
        json_path=args.json,
        plot_path=args.plot,
    )
    for path, what in ((args.json, "JSON"), (args.plot, "plot")):
        if path is not None:
            print(f"wrote {what} to {os.path.abspath(path)}", file=sys.stderr)
    return 0 if report.ok else 1
