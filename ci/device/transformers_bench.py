"""One device call: transformers' own GPT-OSS served by attn/experts "tokenspeed"
(tokenspeed_kernel.integrations.transformers) against transformers' eager attention and its
own experts implementations, in the same run.

1. Checks (bf16 on the device, plus float32 / float64 references):
   - ``tiny``: the CPU test's model (2 layers, hidden 64, 4/2 heads of dim 16, window 4,
     sinks, 4 experts top-2, weights drawn at std 0.2): logits of ours and of eager against
     a float64 eager model; greedy ``generate`` in float32 (tokens must be equal) and in bf16
     (each of our tokens within bf16 resolution of the float64 argmax, equal to eager's where
     the top two logits are resolvable); a left-padded batch in float32.
   - ``full``: GPT-OSS-120B layer widths (hidden 2880, 64 q / 8 KV heads of dim 64,
     intermediate 2880, 128 experts top-4, window 128 on alternating layers, sinks), 2 layers,
     vocabulary ``--vocab``, transformers' own random init: bf16 logits of ours and eager
     against the float32 eager model, float32 ours against float32 eager, bf16 greedy tokens.
2. ``generate`` throughput at full widths, same model and weights, rows switched with
   ``set_attn_implementation`` / ``set_experts_implementation``:
   - ``eager/eager``: transformers' eager attention and its per-expert loop;
   - ``eager/grouped_mm``: transformers' default for GPT-OSS (grouped GEMMs, torch._grouped_mm);
   - ``tokenspeed/tokenspeed``: ours (mha_prefill per layer, a moe_plan per experts module);
   - ``tokenspeed/tokenspeed+topk``: ours plus the router through moe_topk.
   Per batch B and prompt P, ``generate`` of N = ``--new-tokens`` greedy tokens with a logits
   processor that only reads the clock after a device synchronize (once per token): prefill
   = start to first reading (best of ``--reps``), decode step = median difference between
   readings (all reps), decode tokens/s = B / step, end-to-end tokens/s = B·N / total (best).
   Each row is warmed up first (Triton JIT, plans).

Every check and row is in its own try/except: one failure never ends the run. A short table
is printed last; JSON goes to ``--json`` (default ``$OUT/transformers.json`` when OUT is set).

Usage on the device (repo root; wheels built here with ``pip wheel --no-deps -w .whl
packages/tokenspeed-kernel packages/tokenspeed-kernel-triton packages/tokenspeed-kernel-nvidia``,
carried as ``.whl``; the image has transformers 5.x)::

    python3 -m pip install -q --force-reinstall --no-deps --no-index .whl/*.whl && python3 ci/device/transformers_bench.py

CPU smoke test of every path (tiny widths, the kernels under the interpreter)::

    TRITON_INTERPRET=1 python3 ci/device/transformers_bench.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import time
import traceback
from typing import Any

import torch

START = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny widths everywhere (CPU smoke test)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary of the full-width model (default 1024)")
    p.add_argument("--batches", default=None, help="comma-separated (default 1,8; tiny: 1,2)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512; tiny: 12)")
    p.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 64; tiny: 3)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions, best kept (default 3; tiny: 1)")
    p.add_argument("--rows", default="eager/eager,eager/grouped_mm,tokenspeed/tokenspeed,tokenspeed/tokenspeed+topk")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop starting timed rows after this")
    p.add_argument("--json", default=None, help="output JSON (default $OUT/transformers.json if OUT is set)")
    a = p.parse_args(argv)
    a.vocab = a.vocab or (128 if a.tiny else 1024)
    a.batches = [int(x) for x in (a.batches or ("1,2" if a.tiny else "1,8")).split(",")]
    a.prompt = a.prompt or (12 if a.tiny else 512)
    a.new_tokens = a.new_tokens or (3 if a.tiny else 64)
    a.reps = a.reps or (1 if a.tiny else 3)
    if a.json is None and os.environ.get("OUT"):
        a.json = os.path.join(os.environ["OUT"], "transformers.json")
    return a


def short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- models


def tiny_config(vocab: int = 128):
    from transformers import GptOssConfig

    return GptOssConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=48,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=vocab,
        sliding_window=4,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.2,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )


def full_config(vocab: int):
    """GPT-OSS-120B layer widths, 2 layers (window 128, then full), transformers' default
    rope (yarn) and init."""
    from transformers import GptOssConfig

    return GptOssConfig(
        num_hidden_layers=2,
        hidden_size=2880,
        intermediate_size=2880,
        head_dim=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        num_local_experts=128,
        num_experts_per_tok=4,
        vocab_size=vocab,
        sliding_window=128,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )


def build(cfg, dtype: torch.dtype, device: torch.device, impl: str = "eager", seed: int = 0):
    """A random GPT-OSS from ``cfg`` (a fresh copy: the implementation is written into it)."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = GptOssForCausalLM._from_config(
            copy.deepcopy(cfg), attn_implementation=impl, experts_implementation=impl, dtype=dtype
        )
    model.eval()
    model.generation_config.pad_token_id = 0
    return model


def randomize_tiny(model) -> None:
    """The CPU test's extra randomness: order-1 sinks and nonzero expert biases."""
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("sinks"):
                t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float64))
            elif name.endswith("gate_up_proj_bias") or name.endswith("down_proj_bias"):
                t.copy_(0.3 * torch.randn(t.shape, generator=g, dtype=torch.float64))


def set_impl(model, row: str) -> None:
    """Switch the model to a row ``attn/experts[+topk]`` (the router swap undone otherwise)."""
    from tokenspeed_kernel.integrations import transformers as ts_hf

    attn, experts = row.split("/")
    topk = experts.endswith("+topk")
    experts = experts.removesuffix("+topk")
    model.set_attn_implementation(attn)
    model.set_experts_implementation(experts)
    for module in model.modules():
        module.__dict__.pop("forward", None)  # undo an earlier router swap
    if topk:
        ts_hf.use_moe_topk_router(model)


def drop_plans(model) -> None:
    """Forget the integration's cached MoE plans (and their weight copies)."""
    for module in model.modules():
        module.__dict__.pop("_tokenspeed_plan", None)


def clone_as(model, dtype: torch.dtype, impl: str):
    drop_plans(model)  # never deep-copy a plan's weight copies
    other = copy.deepcopy(model).to(dtype)
    set_impl(other, f"{impl}/{impl}")
    return other


def prompt(batch: int, length: int, vocab: int, device: torch.device, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=g).to(device)


def greedy(model, ids: torch.Tensor, new: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids) if mask is None else mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )


def logits(model, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits.double()


# --------------------------------------------------------------------------- checks


class RoutingReplay:
    """Records a model's router outputs in call order and replays them into another model.
    A near tie between two experts' router logits is a discontinuity that bf16 may break
    either way (the two choices give outputs far apart), so bf16 comparisons give both
    sides the same routing: what is compared is then attention and expert numerics."""

    def __init__(self) -> None:
        self.calls: list = []
        self.next = 0
        self.handles: list = []

    @staticmethod
    def routers(model) -> list:
        return [layer.mlp.router for layer in model.model.layers]

    def record(self, model) -> RoutingReplay:
        for router in self.routers(model):
            self.handles.append(router.register_forward_hook(lambda _m, _i, out: self.calls.append(out)))
        return self

    def replay(self, model) -> RoutingReplay:
        self.next = 0

        def hook(_m, _i, out):
            logits, scores, ids = self.calls[self.next]
            self.next += 1
            return logits.to(out[0].dtype), scores.to(out[1].dtype), ids.to(out[2].dtype)

        for router in self.routers(model):
            self.handles.append(router.register_forward_hook(hook))
        return self

    def remove(self) -> RoutingReplay:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        return self


def logits_replayed(model, ids: torch.Tensor, routing: RoutingReplay | None) -> torch.Tensor:
    if routing is None:
        return logits(model, ids)
    routing.replay(model)
    try:
        return logits(model, ids)
    finally:
        routing.remove()


def recorded(model, ids: torch.Tensor) -> tuple[torch.Tensor, RoutingReplay]:
    routing = RoutingReplay().record(model)
    try:
        return logits(model, ids), routing
    finally:
        routing.remove()


def check_logits(name: str, got: torch.Tensor, base: torch.Tensor, ref: torch.Tensor, rel_tol: float) -> dict:
    """ours (``got``) and transformers' eager (``base``) against a higher-precision ``ref``:
    pass when ours is within ``2 x eager's error + rel_tol x max|ref|``."""
    scale = ref.abs().max().item()
    err_ours = (got - ref).abs().max().item()
    err_eager = (base - ref).abs().max().item()
    ok = err_ours <= 2 * err_eager + rel_tol * scale
    log(
        f"{name}: max|logit| {scale:.3f}  ours-ref {err_ours:.3e}  eager-ref {err_eager:.3e}  "
        f"ours-eager {(got - base).abs().max().item():.3e}  {'PASS' if ok else 'FAIL'}"
    )
    return {"check": name, "pass": ok, "scale": scale, "err_ours": err_ours, "err_eager": err_eager}


def check_generate(name: str, ours, eager, ids: torch.Tensor, new: int, rows: tuple[str, str] | None = None) -> dict:
    """Greedy bf16 decoding, ours replaying eager's routing call by call: our tokens must equal
    eager's at each step whose top two eager logits differ by more than 2% of the largest
    logit, up to the first step where the sequences part (at a near tie). ``rows``: ours and
    eager are one model, switched to ``rows[0]`` (eager) then ``rows[1]`` (ours)."""
    if rows:
        set_impl(eager, rows[0])
    routing = RoutingReplay().record(eager)
    with torch.no_grad():
        res = eager.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    if rows:
        set_impl(ours, rows[1])
    routing.remove().replay(ours)
    try:
        got = greedy(ours, ids, new)
    finally:
        routing.remove()
    want, steps = res.sequences, torch.stack(res.logits, dim=1).double()
    start, tol = ids.shape[1], 2e-2 * steps.abs().max().item()
    bad, resolvable, equal = [], 0, int((got[:, start:] == want[:, start:]).sum().item())
    for b in range(got.shape[0]):
        for t in range(new):
            top2 = steps[b, t].topk(2).values
            same = bool(got[b, start + t] == want[b, start + t])
            if top2[0] - top2[1] > tol:
                resolvable += 1
                if not same:
                    bad.append((b, t))
            if not same:
                break
    ok = not bad and routing.next == len(routing.calls)
    log(
        f"{name}: {equal}/{got[:, start:].numel()} tokens equal to eager ({resolvable} resolvable steps), "
        f"{'PASS' if ok else 'FAIL ' + str(bad[:4])}"
    )
    return {"check": name, "pass": ok, "equal": equal, "resolvable": resolvable, "bad": bad[:8]}


def tiny_checks(device: torch.device, results: list) -> None:
    from tokenspeed_kernel.integrations import transformers as ts_hf

    cfg = tiny_config()
    exact = build(cfg, torch.float64, device)
    randomize_tiny(exact)
    ids = prompt(2, 11, 128, device)
    want64, routing = recorded(exact, ids)
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 4e-3)):
        eager, ours = clone_as(exact, dtype, "eager"), clone_as(exact, dtype, "tokenspeed")
        replay = routing if dtype == torch.bfloat16 else None
        ts_hf.reset_kernel_counts()
        got = logits_replayed(ours, ids, replay)
        kernels = {f"{op}:{k}": n for (op, k), n in ts_hf.kernel_counts().items()}
        name = f"tiny logits {str(dtype).removeprefix('torch.')}"
        results.append(check_logits(name, got, logits_replayed(eager, ids, replay), want64, tol))
        results[-1]["kernels"] = kernels
        if dtype == torch.float32:
            got, want = greedy(ours, ids, 4), greedy(eager, ids, 4)
            ok = torch.equal(got, want)
            log(f"tiny generate float32: {'PASS' if ok else 'FAIL'} {got[:, 11:].tolist()} vs {want[:, 11:].tolist()}")
            results.append({"check": "tiny generate float32", "pass": ok})
        else:
            results.append(check_generate("tiny generate bfloat16", ours, eager, ids, 4))
    eager, ours = clone_as(exact, torch.float32, "eager"), clone_as(exact, torch.float32, "tokenspeed")
    ids3 = prompt(3, 11, 128, device)
    mask = torch.ones_like(ids3)
    mask[1, :3] = 0
    mask[2, :7] = 0
    ids3 = ids3.masked_fill(mask == 0, 0)
    got, base = logits(ours, ids3, mask), logits(eager, ids3, mask)
    err = (got - base)[mask.bool()].abs().max().item()
    same = torch.equal(greedy(ours, ids3, 2, mask), greedy(eager, ids3, 2, mask))
    ok = err <= 2e-5 * base.abs().max().item() and same
    log(f"tiny left-padded float32: err {err:.3e}, tokens {'equal' if same else 'DIFFER'}  {'PASS' if ok else 'FAIL'}")
    results.append({"check": "tiny left-padded float32", "pass": ok, "err": err})


def full_checks(model, a: argparse.Namespace, device: torch.device, results: list) -> None:
    """At full widths: ours and eager in bf16 (replaying the float32 model's routing) against
    eager in float32; float32 ours against float32 eager (no replay needed); bf16 greedy
    tokens. Peak memory: the bf16 model, a float32 copy and its float32 plan (about 5x the
    bf16 experts)."""
    ids = prompt(2, min(a.prompt, 300), a.vocab, device)
    ref_model = clone_as(model, torch.float32, "eager")
    try:
        ref, routing = recorded(ref_model, ids)
        set_impl(model, "eager/eager")
        base = logits_replayed(model, ids, routing)
        set_impl(model, "tokenspeed/tokenspeed")
        got = logits_replayed(model, ids, routing)
        results.append(check_logits("full logits bfloat16", got, base, ref, 4e-3))
        rows = ("eager/eager", "tokenspeed/tokenspeed")
        results.append(check_generate("full generate bfloat16", model, model, ids, 8, rows))
        drop_plans(model)  # room for the float32 plan
        cleanup(device)
        try:
            set_impl(ref_model, "tokenspeed/tokenspeed")
            got32 = logits(ref_model, ids)
            err32 = (got32 - ref).abs().max().item()
            ok32 = err32 <= 2e-4 * ref.abs().max().item()
            log(
                f"full logits float32: ours-eager {err32:.3e} (max|logit| {ref.abs().max().item():.3f})  "
                f"{'PASS' if ok32 else 'FAIL'}"
            )
            results.append({"check": "full logits float32", "pass": ok32, "err": err32})
        except Exception as exc:
            results.append({"check": "full logits float32", "pass": False, "error": short_error(exc)})
            traceback.print_exc()
    finally:
        drop_plans(ref_model)
        del ref_model
        cleanup(device)


# --------------------------------------------------------------------------- throughput


class StepClock:
    """A logits processor that only reads the clock (after a device synchronize): transformers
    calls it once per generated token, right after that step's forward, so the first reading
    ends the prefill and the differences between readings are the decode steps."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync(self.device)
        self.times.append(time.perf_counter())
        return scores


def timed_generate(model, ids: torch.Tensor, new: int, reps: int, device: torch.device) -> dict:
    """Prefill ms (best of ``reps``), median decode step over all reps, end-to-end seconds (best)."""
    from transformers import LogitsProcessorList

    prefill, steps, total = [], [], []
    for _ in range(reps):
        clock = StepClock(device)
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                logits_processor=LogitsProcessorList([clock]),
            )
        sync(device)
        total.append(time.perf_counter() - t0)
        prefill.append(clock.times[0] - t0)
        steps += [b - a for a, b in zip(clock.times, clock.times[1:])]
    steps.sort()
    batch = ids.shape[0]
    step = steps[len(steps) // 2] if steps else float("nan")
    return {
        "prefill_ms": 1e3 * min(prefill),
        "decode_step_ms": 1e3 * step,
        "decode_tok_s": batch / step,
        "e2e_tok_s": batch * new / min(total),
    }


def throughput(model, a: argparse.Namespace, device: torch.device) -> list[dict]:
    from tokenspeed_kernel.integrations import transformers as ts_hf

    rows = []
    for row in a.rows.split(","):
        for batch in a.batches:
            rec: dict[str, Any] = {"row": row, "batch": batch, "prompt": a.prompt, "new_tokens": a.new_tokens}
            rows.append(rec)
            if time.time() - START > a.budget_s:
                rec["skipped"] = f"time budget {a.budget_s:.0f}s spent"
                log(f"{row} B={batch}: skipped ({rec['skipped']})")
                continue
            try:
                set_impl(model, row)
                ids = prompt(batch, a.prompt, a.vocab, device)
                greedy(model, ids, 2)  # warm-up: JIT, plans
                ts_hf.reset_kernel_counts()
                rec.update(timed_generate(model, ids, a.new_tokens, a.reps, device))
                rec["kernels"] = sorted({k for (_, k) in ts_hf.kernel_counts()})
                log(
                    f"{row} B={batch}: prefill {rec['prefill_ms']:.1f} ms, decode step {rec['decode_step_ms']:.2f} ms "
                    f"= {rec['decode_tok_s']:.1f} tok/s, e2e {rec['e2e_tok_s']:.1f} tok/s, kernels {rec['kernels']}"
                )
            except Exception as exc:  # one row's failure never ends the run
                rec["error"] = short_error(exc)
                log(f"{row} B={batch}: ERROR {rec['error']}")
                traceback.print_exc()
            cleanup(device)
    set_impl(model, "eager/eager")
    return rows


def table(checks: list[dict], rows: list[dict]) -> str:
    lines = ["", "| check | result |", "| --- | --- |"]
    lines += [f"| {c['check']} | {'PASS' if c.get('pass') else 'FAIL ' + c.get('error', '')} |" for c in checks]
    lines += [
        "",
        "| row (attn/experts) | B | prompt | prefill ms | decode step ms | decode tok/s | e2e tok/s | "
        "decode vs eager/eager |",
    ]
    lines += ["| --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = {r["batch"]: r for r in rows if r["row"] == "eager/eager" and "decode_tok_s" in r}
    for r in rows:
        if "decode_tok_s" not in r:
            lines.append(
                f"| {r['row']} | {r['batch']} | {r['prompt']} | {r.get('error') or r.get('skipped')} | | | | |"
            )
            continue
        ref = base.get(r["batch"])
        speed = f"{r['decode_tok_s'] / ref['decode_tok_s']:.2f}x" if ref else "-"
        lines.append(
            f"| {r['row']} | {r['batch']} | {r['prompt']} | {r['prefill_ms']:.1f} | {r['decode_step_ms']:.2f} | "
            f"{r['decode_tok_s']:.1f} | {r['e2e_tok_s']:.1f} | {speed} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    import transformers

    import tokenspeed_kernel
    from tokenspeed_kernel.integrations import transformers as ts_hf  # registers "tokenspeed"

    env = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenspeed_kernel": tokenspeed_kernel.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "name": ts_hf.NAME,
    }
    log(f"environment: {env}")
    checks: list[dict] = []
    try:
        tiny_checks(device, checks)
    except Exception as exc:
        checks.append({"check": "tiny", "pass": False, "error": short_error(exc)})
        traceback.print_exc()
    cleanup(device)
    model = None
    try:
        cfg = tiny_config(a.vocab) if a.tiny else full_config(a.vocab)
        model = build(cfg, torch.bfloat16, device)
        log(f"full-width model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")
        full_checks(model, a, device, checks)
    except Exception as exc:
        checks.append({"check": "full", "pass": False, "error": short_error(exc)})
        traceback.print_exc()
    rows = throughput(model, a, device) if model is not None else []
    out = {"env": env, "args": vars(a), "checks": checks, "rows": rows}
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        log(f"wrote {a.json}")
    print(table(checks, rows))
    return 0 if all(c.get("pass") for c in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
