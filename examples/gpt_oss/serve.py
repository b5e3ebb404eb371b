"""A serving-like loop: prefill a ragged batch (whole, or in chunks), then decode steps.

:class:`Engine` drives either model (:class:`~examples.gpt_oss.model.GptOssModel` or
:class:`~examples.gpt_oss.torch_path.TorchGptOss`: both have ``forward(input_ids, batch,
kv)`` and ``logits(hidden)``) over one :class:`~examples.gpt_oss.kvcache.PagedKVCache`.
:class:`DecodeRunner` is one decode step for the whole batch over static buffers: on a GPU
it is captured once in a CUDA graph and replayed (the step derives positions and slots on
the device, feeds back the argmax token, and never synchronizes with the host); on a CPU it
runs eagerly. Before each step, outside the graph, it grows the lengths on the device and
updates the model's decode plans (``tokenspeed_kernel.DecodePlan.update``) for the tables'
new contents, so kernels that plan per batch layout stay correct on replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from examples.gpt_oss.kvcache import ForwardBatch, PagedKVCache
from examples.gpt_oss.model import Overrides

__all__ = ["OVERRIDE_PRESETS", "DecodeRunner", "Engine", "GenerateResult", "Model"]

# Kernel names to force a whole backend (the selector's own choice is ``Overrides()``).
OVERRIDE_PRESETS: dict[str, Overrides] = {
    "selector": Overrides(),
    "reference": Overrides(
        prefill="torch_prefill", extend="torch_extend", decode="torch_decode",
        store="torch_store_kvcache", topk="torch_moe_topk", moe="torch_moe",
    ),
    "triton": Overrides(
        prefill="triton_prefill", extend="triton_extend", decode="triton_decode",
        store="triton_store_kvcache", topk="triton_moe_topk", moe="triton_fused_moe",
    ),
}  # fmt: skip


class Model(Protocol):
    """What the engine needs of a model. A model may also have ``plan_decode(batch, kv, *,
    capturable)`` (decode plans kept in ``batch.decode_plans``, see ``GptOssModel``)."""

    @property
    def device(self) -> torch.device: ...

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass
class GenerateResult:
    """``tokens`` int64 ``[B, steps]`` generated greedily; ``prefill_logits`` float32
    ``[B, V]`` of each prompt's last token."""

    tokens: torch.Tensor
    prefill_logits: torch.Tensor


class DecodeRunner:
    """One decode step for requests ``rids`` (consecutive KV rows), over static buffers.

    ``tokens`` int64 ``[B]`` holds each sequence's newest token (the step's input);
    ``logits`` float32 ``[B, V]`` receives the step's output, and the step writes the
    argmax back into ``tokens`` (greedy feedback). With ``advance`` the step first grows
    every sequence by one token (a real decode step); without, it recomputes the current
    last position (benchmarks replay one step at a fixed context).

    Each step is two parts: outside the graph, :meth:`_prepare` adds one to ``cache_seqlens``
    on the device (``advance``) and updates the decode plans for the tables' new contents
    (host work for kernels that plan per layout; a no-op loop otherwise); then the captured
    (or eager) :meth:`_step` reads the tables, writes K/V and runs the layers.

    Args:
        model, kv, rids: what to run and on which requests.
        graph: capture the step in a CUDA graph (``None``: when the device is CUDA).
        advance: see above.
    """

    def __init__(
        self,
        model: Model,
        kv: PagedKVCache,
        rids: Sequence[int],
        *,
        graph: bool | None = None,
        advance: bool = True,
    ) -> None:
        self.model, self.kv, self.rids, self.advance = model, kv, list(rids), advance
        self.batch = kv.decode_batch(self.rids)
        device = kv.device
        self.tokens = torch.zeros(len(self.rids), dtype=torch.int64, device=device)
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        if graph is None:
            graph = device.type == "cuda"
        plan_decode = getattr(model, "plan_decode", None)
        if plan_decode is not None:  # select the decode kernels once, capturable when graphed
            plan_decode(self.batch, kv, capturable=graph)
        if graph:
            self._capture()

    def _update_plans(self) -> None:
        for plan in self.batch.decode_plans or ():
            plan.update()

    def _prepare(self) -> None:
        """Outside the graph: grow every sequence by one token (``advance``), then plan the
        attention for the tables as the step will read them."""
        if self.advance:
            self.kv.check_decode_room(self.rids)
            self.batch.cache_seqlens.add_(1)
        self._update_plans()

    def _step(self) -> None:
        """The captured part: positions/slots from the tables, the model, greedy feedback."""
        self.kv.fill_decode(self.batch, advance=False)
        hidden = self.model.forward(self.tokens, self.batch, self.kv)
        logits = self.model.logits(hidden)
        if self.logits is None:
            self.logits = torch.empty_like(logits)
        self.logits.copy_(logits)
        torch.argmax(logits, dim=-1, out=self.tokens)

    def _capture(self) -> None:
        """Warm up on a side stream (allocations, JIT compiles, plans), restoring the state
        each time, re-plan for the restored tables, then capture one step (capture records,
        it does not run)."""
        device = self.kv.device
        saved = (self.batch.cache_seqlens.clone(), self.tokens.clone())
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._prepare()
                self._step()
                self.batch.cache_seqlens.copy_(saved[0])
                self.tokens.copy_(saved[1])
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        self._update_plans()  # the restore rewrote cache_seqlens: plan for it outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        self.graph = graph

    def step(self) -> torch.Tensor:
        """Run one step (replay when captured); returns the static ``logits`` buffer."""
        self._prepare()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()
        if self.advance:
            self.kv.advance_host(self.rids)
        return self.logits

    def step_eager(self) -> torch.Tensor:
        """One step without the graph (for graph-vs-eager timing)."""
        self._prepare()
        self._step()
        if self.advance:
            self.kv.advance_host(self.rids)
        return self.logits


class Engine:
    """Prefill and decode for a batch of requests on one model and one paged KV cache."""

    def __init__(self, model: Model, kv: PagedKVCache) -> None:
        self.model, self.kv = model, kv

    def add_requests(self, prompt_lens: Sequence[int], max_new_tokens: int, first_rid: int = 0) -> list[int]:
        """Admit ``len(prompt_lens)`` requests with pages reserved for prompt + new tokens."""
        rids = list(range(first_rid, first_rid + len(prompt_lens)))
        for rid, n in zip(rids, prompt_lens):
            self.kv.add(rid, n + max_new_tokens)
        return rids

    def forward_chunk(self, rids: Sequence[int], chunks: Sequence[torch.Tensor], mode: str = "extend") -> torch.Tensor:
        """Append ``chunks[i]`` (int64 token ids) to request ``rids[i]``; returns the
        hidden states ``[sum of chunk lengths, H]`` (``mode="prefill"`` for whole prompts)."""
        batch = self.kv.chunk_batch(list(rids), [len(c) for c in chunks], mode=mode)
        ids = torch.cat(list(chunks)).to(self.kv.device)
        return self.model.forward(ids, batch, self.kv)

    def prefill(
        self, rids: Sequence[int], prompts: Sequence[torch.Tensor], chunk_size: int | None = None
    ) -> torch.Tensor:
        """Prefill prompts (int64 ``[L_i]``); returns float32 last-token logits ``[B, V]``.

        ``chunk_size=None``: one ``mha_prefill`` pass over the ragged batch. Otherwise
        rounds of ``mha_extend_with_kvcache``, each appending up to ``chunk_size`` tokens
        of every unfinished prompt.
        """
        lens = [len(p) for p in prompts]
        last: list[torch.Tensor | None] = [None] * len(prompts)
        if chunk_size is None:
            hidden = self.forward_chunk(rids, prompts, mode="prefill")
            ends = torch.tensor(lens).cumsum(0) - 1
            return self.model.logits(hidden[ends.to(hidden.device)])
        done = [0] * len(prompts)
        while any(d < n for d, n in zip(done, lens)):
            active = [i for i, (d, n) in enumerate(zip(done, lens)) if d < n]
            chunks = [prompts[i][done[i] : done[i] + chunk_size] for i in active]
            hidden = self.forward_chunk([rids[i] for i in active], chunks)
            offset = 0
            for i, c in zip(active, chunks):
                offset += len(c)
                done[i] += len(c)
                if done[i] == lens[i]:
                    last[i] = hidden[offset - 1]
        return self.model.logits(torch.stack(last))

    def generate(
        self,
        prompts: Sequence[torch.Tensor],
        max_new_tokens: int,
        *,
        chunk_size: int | None = None,
        graph: bool | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> GenerateResult:
        """Greedy generation for a ragged batch: prefill, then ``max_new_tokens - 1`` decode
        steps (the first new token comes from the prefill logits). Requests are freed at
        the end. ``graph``: capture the decode step (default: on CUDA)."""
        rids = self.add_requests([len(p) for p in prompts], max_new_tokens)
        try:
            prefill_logits = self.prefill(rids, prompts, chunk_size)
            out = [prefill_logits.argmax(dim=-1)]
            if max_new_tokens > 1:
                runner = DecodeRunner(self.model, self.kv, rids, graph=graph)
                runner.tokens.copy_(out[0])
                for step in range(max_new_tokens - 1):
                    runner.step()
                    out.append(runner.tokens.clone())  # device copy, no sync
                    if on_step is not None:
                        on_step(step)
            return GenerateResult(torch.stack(out, dim=1), prefill_logits)
        finally:
            for rid in rids:
                self.kv.free(rid)
