"""Cases derived from a kernel's registration, and the claims coverage they give (``check``'s
default mode, ``--preset derived``).

A registration is a list of claims the selector trusts from then on: every dtype it lists
per role, every feature, every listed shape range. :func:`derive` turns one kernel's claims
into small cases, each inside what the kernel declares (dtypes, shapes, features and its
predicate), so that none is refused for lack of support:

``base``              the plainest request the kernel serves: bf16 where listed, the
                      features its predicate insists on (a window for a window-only
                      prefill, MXFP4 weights for an MXFP4 kernel);
``dtype-A-B``         every other combination of the dtypes it lists (q x kv, kv x cache,
                      x x weight, logits), under the operator's rule: the second role equals
                      the first, or is fp8 / MXFP4 storage, which brings its feature;
``feature-NAME``      each declared feature alone (with what it cannot go without: an
                      activation in every MoE case, an fp8 weight format for ``fp8_act``);
``features-all[-N]``  the declared features together, one case per member of a set whose
                      members exclude each other (activations, weight formats, scorings);
                      where the predicate refuses the whole set, the largest subsets it
                      accepts, until every feature is in one;
``KEY-VALUE``         each listed shape key at its smallest and its largest value;
``ragged``            attention: a ragged batch with length-1 rows and the operator's padding
                      rows (an empty sequence, an empty chunk, negative slots; decode's
                      contract has none, so decode gets length-1 rows only);
``batch-1``, ``batch-padded``  MoE: one token; a batch ending in padding tokens.

Lengths and the other free choices are drawn from ``seed`` and the case id, so a case
reproduces from ``(kernel, seed, id)``: ``check OP --kernel K --seed S --case ID``. On the CPU,
sizes stay small for the interpreter (keys per sequence <= 48); a listed shape value
above the CPU's cap (:data:`CPU_CAPS`) is left to a GPU and reported ``not run here``. On a
GPU the sequences are longer (<= 640 keys) and every listed edge runs.

:func:`coverage` gives each claim a status: ``checked`` (a case exercising it passed and none
failed), ``failed``, ``not exercised`` (no derived case reaches it; the note says why, e.g. a
dtype the public call does not take, or a feature that needs one the kernel does not declare)
or ``not run here`` (the kernel cannot run on this platform, or the value is above the CPU
cap). Which claims a case exercises is read from the request the public call builds for it,
not from the plan that made it.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from tokenspeed_kernel import selector
from tokenspeed_kernel.operators import operator_schema
from tokenspeed_kernel.ops._checks import ACT_DTYPES, dtype_name
from tokenspeed_kernel.ops.moe.args import ACTIVATIONS
from tokenspeed_kernel.registry import KernelSpec, Request
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.cases import AttentionCase, Case, MoECase

__all__ = [
    "CPU_CAPS",
    "DERIVED",
    "STATUSES",
    "Claim",
    "ClaimRow",
    "Derivation",
    "DerivedCase",
    "coverage",
    "derive",
    "render",
]

DERIVED = "derived"  # the preset name of this mode
STATUSES = ("checked", "failed", "not exercised", "not run here")

_FP8 = torch.float8_e4m3fn
_WEIGHT_FORMATS = ("mxfp4", "fp8_per_tensor", "fp8_per_channel", "fp8_block")
_FP8_FORMATS = _WEIGHT_FORMATS[1:]
_ACT_QUANTS = {"mxfp8_act": "mxfp8", "fp8_act": "fp8"}
_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64", _FP8: "fp8"}


@dataclass(frozen=True)
class Claim:
    """One thing a registration claims: ``kind`` ``dtype`` (``name`` ``role=dtype``, or
    ``role=any`` for a role left out), ``feature``, ``shape`` (``key=value``, the smallest and
    the largest listed value) or ``batch`` (ragged batches and padding rows)."""

    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind} {self.name}"


@dataclass(frozen=True)
class DerivedCase:
    """A case derived for one kernel: its ``id`` (``--case``), its position (the inputs are
    drawn with ``seed + index``) and the claims it exercises."""

    id: str
    index: int
    case: Case
    claims: tuple[Claim, ...]


@dataclass
class Derivation:
    """What :func:`derive` made of one kernel: its claims, its cases, and for each claim no
    case reaches, why (``notes``); ``far``: claims left to a GPU (above the CPU caps)."""

    spec: KernelSpec
    seed: int
    claims: list[Claim]
    cases: list[DerivedCase]
    notes: dict[Claim, str] = field(default_factory=dict)
    far: dict[Claim, str] = field(default_factory=dict)

    def case(self, case_id: str) -> DerivedCase:
        """The case called ``case_id``; ``ValueError`` listing the kernel's case ids otherwise."""
        found = next((c for c in self.cases if c.id == case_id), None)
        if found is None:
            ids = ", ".join(c.id for c in self.cases) or "none"
            raise ValueError(f"--case {case_id!r}: {self.spec.name} has no derived case of that id; its cases: {ids}")
        return found


@dataclass(frozen=True)
class ClaimRow:
    """One claim of one kernel after a run: its status (one of :data:`STATUSES`), the ids of
    the cases that exercise it, and a note (why not exercised or not run; the failing cases;
    for a ``role=any`` claim the dtypes it was checked with)."""

    op: str
    kernel: str
    kind: str
    claim: str
    status: str
    cases: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class _Sizes:
    """How large derived cases are on a device type. ``max_len``: keys per sequence at most;
    ``chunk``: new tokens per sequence (extend, store) at most; ``window``: largest drawn
    ``window_left``; ``tokens``: MoE tokens of ``batch-padded``; ``hidden``/``intermediate``:
    MoE sizes; ``caps``: shape key -> the largest value run here."""

    max_len: int
    chunk: int
    window: int
    tokens: int
    hidden: int
    intermediate: int
    caps: dict[str, int]


# On the CPU, listed shape values above these are left to a GPU (``not run here``).
CPU_CAPS = {
    "batch_bucket": 16,
    "max_seqlen_q_bucket": 256,
    "num_tokens_bucket": 64,
    "num_experts": 64,
    "hidden": 512,
    "intermediate": 512,
    "num_q_heads": 64,
}
_SIZES = {
    "cpu": _Sizes(max_len=48, chunk=12, window=24, tokens=33, hidden=128, intermediate=64, caps=CPU_CAPS),
    "gpu": _Sizes(max_len=640, chunk=160, window=160, tokens=300, hidden=512, intermediate=256, caps={}),
}

# The value a shape key takes when the kernel lists it: the listed value nearest this one.
_NATURAL = {
    "head_dim": 64,
    "num_q_heads": 8,
    "num_kv_heads": 2,
    "page_size": 16,
    "kv_align": 16,
    "q_align": 16,
    "q_len": 2,
    "window_left": 16,
    "batch_bucket": 4,
    "max_seqlen_q_bucket": 32,
    "num_experts": 8,
    "top_k": 2,
    "hidden": 128,
    "intermediate": 64,
    "num_tokens_bucket": 4,
}
# Shape keys a request carries only with a feature: key -> (feature, does a value need it).
_TIED: dict[str, tuple[str, Callable[[int], bool]]] = {
    "q_len": ("spec_decode", lambda v: v > 1),
    "window_left": ("sliding_window", lambda v: v >= 0),
    "kv_align": ("strided_kv", lambda v: True),
    "q_align": ("strided_q", lambda v: True),
}


@dataclass(frozen=True)
class _Plan:
    """A case before it is built: the first role's dtype, the features, shape keys set
    (listed keys at their chosen value, plus the edge a plan is for), the batch kind."""

    id: str
    dtype: torch.dtype
    features: frozenset[str]
    shapes: tuple[tuple[str, int], ...]
    batch: str = ""
    targets: tuple[Claim, ...] = ()


def _draw(rng: random.Random, lo: int, hi: int) -> int:
    return rng.randint(lo, max(lo, hi))


# Per operator, the rows a ragged batch starts with: (new tokens, keys) of a length-1 row
# and of the operator's padding row (decode's contract has none: cache_seqlens >= q_len).
_RAGGED_ROWS: dict[str, Callable[[random.Random, int, int], list[tuple[int, int]]]] = {
    "attention.prefill": lambda rng, n, q_len: [(1, 1), (0, 0)],
    "attention.extend": lambda rng, n, q_len: [(1, 1), (0, _draw(rng, 1, n))],
    "attention.decode": lambda rng, n, q_len: [(q_len, q_len)],
    "kvcache.store": lambda rng, n, q_len: [(1, 1), (1, 1 + _draw(rng, 0, n))],
}


def _attention_rows(op: str, plan: _Plan, sizes: _Sizes, rng: random.Random, q_len: int) -> tuple[list, list]:
    """``(seqlens_q, seqlens_k)`` of an attention or store case: random rows, and for a
    ``ragged`` plan a length-1 row and the operator's padding row first."""
    shapes = dict(plan.shapes)
    batch = shapes.get("batch_bucket", 5 if plan.batch else 3)
    bucket = shapes.get("max_seqlen_q_bucket")
    prefix = 0 if shapes.get("kv_prefix") == 0 else 8  # kv_prefix=0: each sequence's keys are its queries
    n = sizes.max_len

    def row() -> tuple[int, int]:
        if op == "attention.prefill":
            hi = bucket or n
            q = _draw(rng, min(2, hi), hi)
            return q, q + _draw(rng, 0, prefix)
        if op == "attention.decode":
            return q_len, q_len + _draw(rng, 0, n)
        new = _draw(rng, 2, sizes.chunk)
        return new, new + _draw(rng, 0, n)

    special = _RAGGED_ROWS[op](rng, n, q_len) if plan.batch else []
    rows = (special + [row() for _ in range(batch)])[:batch]
    if bucket is not None:  # the longest query makes the bucket: in (bucket/2, bucket]
        rows[-1] = (bucket, bucket + _draw(rng, 0, prefix))
    return [q for q, _ in rows], [k for _, k in rows]


def _attention(op: str, plan: _Plan, sizes: _Sizes, rng: random.Random) -> AttentionCase:
    s, f = dict(plan.shapes), plan.features
    d = s.get("head_dim", 64)
    dv = s.get("head_dim_v", d)
    hkv = s.get("num_kv_heads", 2 if s.get("num_q_heads", 8) % 2 == 0 else 1)
    hq = hkv if op == "kvcache.store" else s.get("num_q_heads", 4 * hkv)
    q_len = s.get("q_len", _draw(rng, 2, 4) if "spec_decode" in f else 1)
    seqlens_q, seqlens_k = _attention_rows(op, plan, sizes, rng, q_len)
    return AttentionCase(
        op,
        tuple(seqlens_q),
        tuple(seqlens_k),
        hq,
        hkv,
        d,
        dv if dv != d else None,
        page_size=s.get("page_size", 16),
        dtype=plan.dtype,
        kv_dtype=_FP8 if "fp8_kv" in f else None,
        causal="non_causal" not in f,
        window_left=s.get("window_left", _draw(rng, 0, sizes.window)) if "sliding_window" in f else -1,
        sinks="sinks" in f,
        logit_cap=rng.choice((5.0, 20.0)) if "logit_cap" in f else 0.0,
        return_lse="return_lse" in f,
        name=plan.id,
        cache_layout="vllm" if "strided_kv" in f else "nhd",
        misaligned="unaligned_qkv" in f,
        strided_q="strided_q" in f,
        strided_rows="strided_rows" in f,
    )


def _tokens(plan: _Plan, sizes: _Sizes, rng: random.Random, most: int) -> int:
    if plan.batch:
        return {"one": 1, "padded": sizes.tokens}[plan.batch]
    return dict(plan.shapes).get("num_tokens_bucket", _draw(rng, 2, most))


def _moe_topk(op: str, plan: _Plan, sizes: _Sizes, rng: random.Random) -> MoECase:
    s, f = dict(plan.shapes), plan.features
    tokens = _tokens(plan, sizes, rng, 40)
    top_k = s.get("top_k", 2)
    return MoECase(
        op,
        tokens,
        0,
        0,
        s.get("num_experts", max(8, top_k)),
        top_k,
        plan.dtype,
        scoring=next(x for x in ("softmax", "sigmoid") if x in f),
        renormalize="renormalize" in f,
        name=plan.id,
        padding_rows=min(3, tokens - 1) if plan.batch == "padded" else 0,
    )


def _moe_apply(op: str, plan: _Plan, sizes: _Sizes, rng: random.Random) -> MoECase:
    s, f = dict(plan.shapes), plan.features
    fmt = next((w for w in _WEIGHT_FORMATS if w in f), "plain")
    tokens = _tokens(plan, sizes, rng, 8)
    top_k = s.get("top_k", 2)
    return MoECase(
        op,
        tokens,
        s.get("hidden", max(sizes.hidden, 256) if fmt == "fp8_block" else sizes.hidden),
        s.get("intermediate", sizes.intermediate),
        s.get("num_experts", max(8, top_k)),
        top_k,
        plan.dtype,
        weight_format=fmt,
        activation=next(a for a in ACTIVATIONS if a in f),
        bias="bias" in f,
        expert_map="expert_map" in f,
        activation_quant=next((q for feat, q in _ACT_QUANTS.items() if feat in f), None),
        name=plan.id,
        padding_rows=min(3, tokens - 1) if plan.batch == "padded" else 0,
    )


@dataclass(frozen=True)
class _Rules:
    """How an operator's requests are put together. ``primary``: the activation dtype role;
    ``secondary``: the role that equals it unless it holds one of the ``special`` dtypes,
    each bringing one of its features; ``groups``: exactly one member of each in every
    request; ``exclusive``: at most one member of each; ``requires``: a feature and the
    features one of which must come with it; ``batches``: the batch plans, each with the
    claim it exercises."""

    primary: str
    secondary: str | None
    special: tuple[tuple[torch.dtype, tuple[str, ...]], ...]
    build: Callable[[str, _Plan, _Sizes, random.Random], Case]
    batches: tuple[tuple[str, str, str], ...]
    groups: tuple[tuple[str, ...], ...] = ()
    exclusive: tuple[tuple[str, ...], ...] = ()
    requires: tuple[tuple[str, tuple[str, ...]], ...] = ()


_FP8_KV = ((_FP8, ("fp8_kv",)),)
_MOE_BATCHES = (("batch-1", "one", "T=1"), ("batch-padded", "padded", "padding tokens"))
_RULES: dict[str, _Rules] = {
    "attention.prefill": _Rules(
        "q", "kv", (), _attention, (("ragged", "ragged", "ragged with length-1 and empty sequences"),)
    ),
    "attention.extend": _Rules(
        "q", "kv", _FP8_KV, _attention, (("ragged", "ragged", "ragged with length-1 rows and an empty chunk"),)
    ),
    "attention.decode": _Rules(
        "q", "kv", _FP8_KV, _attention, (("ragged", "ragged", "ragged with length-1 rows (no padding row in decode)"),)
    ),
    "kvcache.store": _Rules(
        "kv", "cache", _FP8_KV, _attention, (("ragged", "ragged", "ragged with length-1 rows and padding slots"),)
    ),
    "moe.topk": _Rules("logits", None, (), _moe_topk, _MOE_BATCHES, groups=(("softmax", "sigmoid"),)),
    "moe.apply": _Rules(
        "x",
        "weight",
        ((torch.uint8, ("mxfp4",)), (_FP8, _FP8_FORMATS)),
        _moe_apply,
        _MOE_BATCHES,
        groups=(ACTIVATIONS,),
        exclusive=(_WEIGHT_FORMATS, tuple(_ACT_QUANTS)),
        requires=(("mxfp8_act", ("mxfp4",)), ("fp8_act", _FP8_FORMATS)),
    ),
}


def _nearest(values: frozenset[int] | list[int], target: int) -> int:
    return min(values, key=lambda v: (abs(v - target), v))


def _edges(values: frozenset[int]) -> list[int]:
    return sorted({min(values), max(values)})


class _Deriver:
    """Builds one kernel's :class:`Derivation` (see the module docstring)."""

    def __init__(self, spec: KernelSpec, sizes: _Sizes, seed: int):
        self.spec, self.sizes, self.seed = spec, sizes, seed
        self.rules = _RULES[spec.op]
        self.roles = operator_schema(spec.op).dtype_roles
        self.declared = dict(spec.dtypes)
        self.shapes = dict(spec.shapes)
        self.notes: dict[Claim, list[str]] = {}
        self.far: dict[Claim, str] = {}
        self.cases: list[DerivedCase] = []
        self._seen: dict[tuple, str] = {}

    # -- claims -------------------------------------------------------------------------
    def claims(self) -> list[Claim]:
        out = []
        for role in self.roles:
            allowed = self.declared.get(role)
            names = ["any"] if allowed is None else sorted(map(dtype_name, allowed))
            out += [Claim("dtype", f"{role}={name}") for name in names]
        out += [Claim("feature", f) for f in sorted(self.spec.features)]
        out += [Claim("shape", f"{key}={v}") for key, values in self.shapes.items() for v in _edges(values)]
        out += [Claim("batch", claim) for _, _, claim in self.rules.batches]
        return out

    def exercised(self, request: Request, plan: _Plan) -> tuple[Claim, ...]:
        out = []
        for role in self.roles:
            dtype = request.dtype(role)
            if dtype is not None:
                out.append(Claim("dtype", f"{role}={'any' if role not in self.declared else dtype_name(dtype)}"))
        out += [Claim("feature", f) for f in sorted(request.features & self.spec.features)]
        for key, values in self.shapes.items():
            value = request.shape(key)
            if value is not None and value in _edges(values):
                out.append(Claim("shape", f"{key}={value}"))
        out += [Claim("batch", claim) for _, kind, claim in self.rules.batches if kind == plan.batch]
        return tuple(out)

    def claim_shapes(self, request: Request) -> tuple[tuple[str, int], ...]:
        """The request's values of the shape keys the kernel lists (the others claim
        nothing, and some vary with the drawn lengths and window)."""
        return tuple((k, v) for k, v in request.shapes if k in self.shapes)

    # -- features -----------------------------------------------------------------------
    def complete(self, features: set[str] | frozenset[str]) -> frozenset[str] | str:
        """``features`` with one member of every group and what each feature needs; a reason
        (str) when that cannot be done within the declared features."""
        f = set(features)
        for group in self.rules.groups:
            if len(f & set(group)) > 1:
                return f"{' and '.join(sorted(f & set(group)))} exclude each other"
            declared = [m for m in group if m in self.spec.features]
            if not f & set(group):
                if not declared:
                    return f"declares none of {', '.join(group)}"
                f.add(declared[0])
        for feature, needs in self.rules.requires:
            if feature in f and not f & set(needs):
                declared = [n for n in needs if n in self.spec.features]
                if not declared:
                    return f"{feature} needs one of {', '.join(needs)}, none declared"
                f.add(declared[0])
        for group in self.rules.exclusive:
            if len(f & set(group)) > 1:
                return f"{' and '.join(sorted(f & set(group)))} exclude each other"
        return frozenset(f)

    def without_orphans(self, features: set[str], keep: str = "") -> set[str]:
        """``features`` less those whose required features are all absent (but ``keep``)."""
        return {
            f for f in features if f == keep or all(f != need or features & set(n) for need, n in self.rules.requires)
        }

    def shapes_for(self, features: frozenset[str], edge: tuple[str, int] | None = None) -> tuple:
        out = {}
        for key, values in self.shapes.items():
            if key == "head_dim_v":  # follows head_dim (the repairs pick a listed one)
                continue
            tied = _TIED.get(key)
            usable = [v for v in values if tied is None or (tied[0] in features and tied[1](v))]
            if usable:
                out[key] = _nearest(usable, _NATURAL.get(key, 0))
        if edge is not None:
            out[edge[0]] = edge[1]
        return tuple(sorted(out.items()))

    # -- realizing a plan -----------------------------------------------------------------
    def refusals(self, case: Case) -> tuple[str, ...]:
        """Why the kernel's registration refuses ``case`` (``()``: it claims to serve it)."""
        return selector.request_reasons(self.spec, cases.request(case))

    def repairs(self, case: Case) -> Iterator[Case]:
        """Neighbours of a refused case that keep its claims: other strided layouts, head
        dims the predicate accepts together, a narrower window, fewer MoE tokens."""
        if isinstance(case, AttentionCase):
            if case.cache_layout != "nhd":
                yield from (dataclasses.replace(case, cache_layout=layout) for layout in ("hnd", "stacked"))
            dvs = self.shapes.get("head_dim_v")
            if dvs and case.dv not in dvs:
                yield dataclasses.replace(case, head_dim_v=_nearest(dvs, case.dv))
            if case.head_dim_v is not None:
                yield dataclasses.replace(case, head_dim=case.dv, head_dim_v=None)
            if case.window_left > 16:  # a window a band kernel bounds
                yield dataclasses.replace(case, window_left=16)
        elif case.num_tokens > 8:
            yield dataclasses.replace(case, num_tokens=8, padding_rows=min(case.padding_rows, 3))

    def build(self, plan: _Plan) -> tuple[Case | None, str]:
        """The case of ``plan`` inside the kernel's declaration, or ``(None, why not)``."""
        over = [(k, v) for k, v in plan.shapes if v > self.sizes.caps.get(k, v)]
        if over:
            key, value = over[0]
            return None, f"far:{key}={value} is above the CPU cap {self.sizes.caps[key]} (run it on a GPU)"
        rng = random.Random(f"{self.seed}:{self.spec.name}:{plan.id}")
        try:
            case = self.rules.build(self.spec.op, plan, self.sizes, rng)
        except ValueError as exc:
            return None, f"not a valid case: {exc}"
        why = self.refusals(case)
        if not why:
            return case, ""
        for other in self.repairs(case):
            try:
                if not self.refusals(other):
                    return other, ""
            except ValueError:
                continue
        return None, "; ".join(why)

    def add(self, plan: _Plan | None) -> bool:
        """Build ``plan`` and keep its case (unless a kept case has the same dtypes, features,
        shapes and batch kind: it exercises the same claims); a plan that cannot be built leaves its reason on
        the claims it was for. None (a plan that could not be made) is skipped."""
        if plan is None:
            return False
        case, why = self.build(plan)
        if case is None:
            for claim in plan.targets:
                if why.startswith("far:"):
                    self.far.setdefault(claim, why[4:])
                else:
                    self.notes.setdefault(claim, []).append(f"{plan.id}: {why}")
            return False
        request = cases.request(case)
        key = (request.dtypes, request.features, self.claim_shapes(request), plan.batch)
        if key in self._seen:
            return True
        self._seen[key] = plan.id
        self.cases.append(DerivedCase(plan.id, len(self.cases), case, self.exercised(request, plan)))
        return True

    def plan(
        self,
        pid: str,
        dtype: torch.dtype,
        features: set[str] | frozenset[str],
        *,
        edge: tuple[str, int] | None = None,
        batch: str = "",
        targets: tuple[Claim, ...] = (),
    ) -> _Plan | None:
        """A plan of ``features`` completed (:meth:`complete`), or None with a note on
        ``targets`` when they cannot be completed."""
        done = self.complete(features)
        if isinstance(done, str):
            for claim in targets:
                self.notes.setdefault(claim, []).append(f"{pid}: {done}")
            return None
        return _Plan(pid, dtype, done, self.shapes_for(done, edge), batch, tuple(targets))

    # -- the plans ----------------------------------------------------------------------
    def primaries(self) -> list[torch.dtype]:
        allowed = self.declared.get(self.rules.primary, ACT_DTYPES)
        return [d for d in ACT_DTYPES if d in allowed]

    def base(self, dtype: torch.dtype) -> tuple[frozenset[str] | None, str]:
        """The base features: one per group, plus the first declared feature (with what it
        needs) that makes a refused base fit; ``(None, why)`` when nothing does."""
        singles = [f for f in sorted(self.spec.features) if not any(f in g for g in self.rules.groups)]
        first_why = ""
        for extra in [(), *((f,) for f in singles)]:
            plan = self.plan("base", dtype, set(extra))
            if plan is None:
                continue
            case, why = self.build(plan)
            if case is not None:
                return plan.features, ""
            first_why = first_why or why
        return None, first_why or "its features cannot be combined"

    def run(self) -> Derivation:
        claims = self.claims()
        self.note_domain(claims)
        primaries = self.primaries()
        base, why = self.base(primaries[0]) if primaries else (None, "it lists no dtype the public call takes")
        if base is None:
            for claim in claims:
                if why.startswith("far:"):
                    self.far.setdefault(claim, why[4:])
                else:
                    self.notes.setdefault(claim, []).append(f"no request inside the registration: {why}")
            return self.result(claims)
        dtype = primaries[0]
        self.add(self.plan("base", dtype, base))
        for plan in self.dtype_plans(base, primaries):
            self.add(plan)
        for feature in sorted(self.spec.features):
            self.add(self.feature_plan(base, dtype, feature))
        self.add_together(dtype)
        for key, values in self.shapes.items():
            tied = _TIED.get(key)
            for value in _edges(values):
                features = set(base) | ({tied[0]} if tied and tied[1](value) else set())
                claim = Claim("shape", f"{key}={value}")
                self.add(self.plan(f"{key}-{value}", dtype, features, edge=(key, value), targets=(claim,)))
        for pid, kind, batch_claim in self.rules.batches:
            self.add(self.plan(pid, dtype, base, batch=kind, targets=(Claim("batch", batch_claim),)))
        return self.result(claims)

    def dtype_plans(self, base: frozenset[str], primaries: list[torch.dtype]) -> Iterator[_Plan | None]:
        """Every listed combination of the two dtype roles: the second equal to the first
        (the base's features less those a special dtype brings), or special (its feature)."""
        special = dict(self.rules.special)
        brought = {f for feats in special.values() for f in feats}
        second = self.rules.secondary
        listed = self.declared.get(second) if second is not None else None
        for first in primaries:
            targets = (Claim("dtype", f"{self.rules.primary}={dtype_name(first)}"),)
            plain = self.without_orphans(set(base) - brought)
            if listed is None or first in listed:
                yield self.plan(f"dtype-{_SHORT[first]}", first, plain, targets=targets)
            for other in sorted(listed or (), key=str):
                if other == first or other not in special:
                    continue
                claim = Claim("dtype", f"{second}={dtype_name(other)}")
                brings = [f for f in special[other] if f in self.spec.features]
                if not brings:
                    needs = " or ".join(special[other])
                    self.notes.setdefault(claim, []).append(f"{second}={dtype_name(other)} needs feature {needs}")
                    continue
                features = self.without_orphans((set(base) - brought) | {brings[0]})
                pid = f"dtype-{_SHORT[first]}-{_SHORT.get(other, dtype_name(other))}"
                yield self.plan(pid, first, features, targets=(*targets, claim))

    def feature_plan(self, base: frozenset[str], dtype: torch.dtype, feature: str) -> _Plan | None:
        """``feature`` alone: the base with ``feature`` in place of the members of its group or
        exclusive set, less what no longer has what it needs."""
        features = set(base)
        for members in self.rules.groups + self.rules.exclusive:
            if feature in members:
                features -= set(members)
        features = self.without_orphans(features | {feature}, keep=feature)
        return self.plan(f"feature-{feature}", dtype, features, targets=(Claim("feature", feature),))

    def add_together(self, dtype: torch.dtype) -> None:
        """The declared features together: one round per member of the largest group or
        exclusive set; a round the kernel refuses as a whole (its predicate) is replaced by
        its largest subsets the kernel accepts, until each of its features is in one."""
        sets = self.rules.groups + self.rules.exclusive
        declared = self.spec.features
        alone = {f for f in declared if not any(f in members for members in sets)}
        chosen = [[m for m in members if m in declared] for members in sets]
        rounds = max([len(c) for c in chosen] + [1])
        grouped = {m for g in self.rules.groups for m in g}
        for i in range(rounds):
            features = self.without_orphans(alone | {c[i % len(c)] for c in chosen if c})
            pid = "features-all" if rounds == 1 else f"features-all-{i + 1}"
            plan = self.plan(pid, dtype, features)
            if plan is None or self.add(plan):
                continue
            covered: set[str] = set()
            for drop in sorted(plan.features - grouped):
                if plan.features - {drop} <= covered:
                    continue
                smaller = self.plan(f"{pid}-no-{drop}", dtype, self.without_orphans(set(plan.features) - {drop}))
                if smaller is not None and self.add(smaller):
                    covered |= smaller.features
                if covered >= plan.features:
                    break

    def note_domain(self, claims: list[Claim]) -> None:
        """Notes for listed dtypes the public call does not take (e.g. float64)."""
        special = [d for d, _ in self.rules.special]
        taken = {self.rules.primary: ACT_DTYPES, self.rules.secondary: (*ACT_DTYPES, *special)}
        for role, allowed in self.declared.items():
            domain = taken.get(role, ACT_DTYPES)
            for dtype in sorted(allowed - set(domain), key=str):
                names = ", ".join(map(dtype_name, domain))
                claim = Claim("dtype", f"{role}={dtype_name(dtype)}")
                self.notes.setdefault(claim, []).append(f"the public call takes {role} in {names} only")

    def result(self, claims: list[Claim]) -> Derivation:
        notes = {claim: "; ".join(dict.fromkeys(reasons)) for claim, reasons in self.notes.items()}
        return Derivation(self.spec, self.seed, claims, self.cases, notes, dict(self.far))


def derive(spec: KernelSpec, device_type: str = "cpu", seed: int = 0) -> Derivation:
    """The cases derived from ``spec``'s registration for a device of ``device_type``
    (``cpu``: small sizes and the CPU caps; anything else: GPU sizes), drawn with ``seed``.
    Builds requests and case descriptions only: no tensor, no kernel call."""
    sizes = _SIZES["cpu" if device_type == "cpu" else "gpu"]
    return _Deriver(spec, sizes, seed).run()


def _blamed(derivation: Derivation, verdicts: dict[str, str]) -> dict[Claim, list[str]]:
    """Claim -> the failing cases it is blamed for: of a failing case's claims, those no
    passing case exercises too; all of them when none is left (a combination fails)."""
    passed = {claim for c in derivation.cases if verdicts.get(c.id) == "PASS" for claim in c.claims}
    blamed: dict[Claim, list[str]] = {}
    for c in derivation.cases:
        if verdicts.get(c.id) == "FAIL":
            for claim in [x for x in c.claims if x not in passed] or c.claims:
                blamed.setdefault(claim, []).append(c.id)
    return blamed


def coverage(derivation: Derivation, verdicts: dict[str, str], not_run: str = "") -> list[ClaimRow]:
    """Each claim's status after a run. ``verdicts``: case id -> ``PASS``/``FAIL``/``SKIP``
    for the cases that ran (a subset when ``--case`` picked one: claims none of them touch
    are left out); ``not_run``: why the kernel cannot run on this platform ("" when it can).

    A failing case fails the claims it exercises that no passing case exercises too (a
    wrong sinks term fails ``feature sinks``, not the dtypes its case also had), or all of
    them when every one passed elsewhere (a combination fails); a claim that passed and is
    also in a failing case is ``checked``, its note naming that case."""
    spec = derivation.spec
    partial = not not_run and len(verdicts) < len(derivation.cases)
    blamed = _blamed(derivation, verdicts)
    rows = []
    for claim in derivation.claims:
        ids = tuple(c.id for c in derivation.cases if claim in c.claims)
        ran = [i for i in ids if i in verdicts]
        if partial and not ran:
            continue
        note = derivation.notes.get(claim, "")
        failing = [i for i in ran if verdicts[i] == "FAIL"]
        if not ids:
            status = "not run here" if claim in derivation.far else "not exercised"
            note = derivation.far.get(claim) or note or "no derived case reaches it"
        elif not_run:
            status, note = "not run here", not_run
        elif claim in blamed:
            status, note = "failed", "failed: " + ", ".join(blamed[claim])
        elif any(verdicts[i] == "PASS" for i in ran):
            also = f"also in failing {', '.join(failing)}" if failing else ""
            status, note = "checked", "; ".join(filter(None, (_any_note(claim, derivation, ran, verdicts), also)))
        else:
            status, note = "not exercised", "every case exercising it was skipped"
        rows.append(ClaimRow(spec.op, spec.name, claim.kind, claim.name, status, ids, note))
    return rows


def _any_note(claim: Claim, derivation: Derivation, ran: list[str], verdicts: dict[str, str]) -> str:
    """For a ``role=any`` claim: the dtypes it was checked with."""
    if not claim.name.endswith("=any"):
        return ""
    role = claim.name.split("=")[0]
    passed = [c for c in derivation.cases if c.id in ran and verdicts[c.id] == "PASS"]
    names = {dtype_name(d) for c in passed if (d := cases.request(c.case).dtype(role)) is not None}
    return "with " + ", ".join(sorted(names))


def render(rows: list[ClaimRow]) -> list[str]:
    """The coverage as text: per kernel a head line with its counts, then per status the
    claims grouped by kind (notes for those not checked)."""
    lines = []
    kernels = list(dict.fromkeys((r.op, r.kernel) for r in rows))
    for op, kernel in kernels:
        mine = [r for r in rows if r.kernel == kernel]
        counts = ", ".join(f"{n} {s}" for s in STATUSES if (n := sum(r.status == s for r in mine)))
        head = f"{kernel} ({op}): {len(mine)} claims: {counts}"
        if all(r.status == "not run here" for r in mine) and len({r.note for r in mine}) == 1:
            lines.append(f"{head} ({mine[0].note})")
            continue
        lines.append(head)
        for status in STATUSES:
            chosen = [r for r in mine if r.status == status]
            if not chosen:
                continue
            if status == "checked":  # one line per kind, the claims side by side
                kinds = [k for k in ("dtype", "feature", "shape", "batch") if any(r.kind == k for r in chosen)]
                for i, kind in enumerate(kinds):
                    names = [r.claim + (f" ({r.note})" if r.note else "") for r in chosen if r.kind == kind]
                    label = f"  {status:<14} " if i == 0 else " " * 17
                    lines.append(f"{label}{kind} " + " ".join(names))
                continue
            for i, r in enumerate(chosen):
                label = f"  {status:<14} " if i == 0 else " " * 17
                lines.append(f"{label}{r.kind} {r.claim}" + (f" ({r.note})" if r.note else ""))
    return lines
