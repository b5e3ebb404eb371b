"""Expert parallelism (moe_dispatch / moe_combine / moe_dispatch_plan) on gloo process groups of
2 and 4 spawned CPU ranks, against the single-process float64 MoE (support/ep_worker.py runs
the scenarios on each rank). Every collective times out after 30 s (the group's timeout) and
the ranks are killed if they have not all reported within 150 s: a hang fails, it never blocks."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import ep_worker
from tokenspeed_kernel_dev.ranks import run_ranks

# Only the core's kernels in the ranks: each spawned process then imports no backend wheel.
_ENV = {"TOKENSPEED_KERNEL_DISABLE_BACKENDS": "triton,nvidia,amd", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("world", [2, 4])
def test_every_scenario_passes_on_every_rank(world):
    done = run_ranks(ep_worker.run, world, env=_ENV, timeout_s=30, deadline_s=150)
    names = [scenario.__name__ for scenario in ep_worker.SCENARIOS]
    assert done == [names] * world


_BENCH = Path(__file__).resolve().parents[4] / "ci" / "device" / "ep_bench.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("ep_bench", _BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_device_bench_defaults_to_gpt_oss_on_two_gpus_with_multicast_off():
    bench = _bench_module()
    args = bench.parse([])
    assert args.token_counts == [1, 64, 4096] and args.world == 2 and not args.cpu
    assert args.shapes == {"experts": 128, "top_k": 4, "hidden": 2880, "intermediate": 2880}
    assert bench.MULTICAST_OFF == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    assert args.budget_s < 8 * 60
    with pytest.raises(SystemExit):
        bench.parse(["--world", "1"])


def test_the_device_bench_runs_its_numerics_and_table_on_gloo_ranks(tmp_path):
    """The bench's --cpu form: 2 gloo ranks, small shapes, MXFP4 weights, numerics against the
    one-process moe_apply and float64, every timed call, the table; within 120 s."""
    out = tmp_path / "ep_bench.json"
    env = {**os.environ, **_ENV}
    done = subprocess.run(
        [sys.executable, str(_BENCH), "--cpu", "--tokens", "3", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "numerics: all within tolerance" in done.stdout
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert report["env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    assert row["ok"] and row["dispatch_kernel"] == "torch_moe_dispatch_padded"
    assert row["functional_vs_plan"]["rel_l2"] == 0.0
    assert row["ep_vs_float64"]["rel_l2"] < 2e-2 and row["ep_vs_one_gpu"]["rel_l2"] < 2e-2
    assert set(row["times"]) == {
        "one_gpu_T",
        "one_gpu_WT",
        "ep_layer",
        "ep_dispatch",
        "ep_experts",
        "ep_combine",
        "nccl_all_to_all",
    }
    assert row["bytes_per_rank"] == 2 * 3 * 64 * 2  # W * C * H bf16


# The checks across ranks are plain functions of the gathered facts: every rank calls them on
# the same values and decides alike. Here without a process group.


def test_the_maps_must_give_each_expert_to_exactly_one_rank():
    from tokenspeed_kernel.ops.moe._validate import check_expert_owners

    assert check_expert_owners([[0, -1, 1, -1], [-1, 0, -1, 5]]) == [0, 1, 0, 1]
    assert check_expert_owners([[0, 1, 2], [-1, -1, -1]]) == [0, 0, 0]  # a rank may hold none
    with pytest.raises(ValueError, match=r"experts \[1, 3\] \(2\) are held by no rank .* E = 4\)"):
        check_expert_owners([[0, -1, 1, -1], [-1, -1, -1, -1]])
    with pytest.raises(ValueError, match=r"expert 0: ranks \[0, 1\].*hold \[2, 2\] experts.*another world size"):
        check_expert_owners([[0, 1, -1], [0, -1, 1]])
    with pytest.raises(ValueError, match=r"values must be >= -1 .* on ranks \[1\]"):
        check_expert_owners([[0, -1], [-1, -2]])


def test_disagreeing_ranks_are_named_with_their_values():
    from tokenspeed_kernel.ops.moe._validate import EP_DTYPES, check_dispatch_agreement

    same = (5, 16, 2, 8, EP_DTYPES.index(torch.bfloat16) + 1)
    check_dispatch_agreement("moe_dispatch", [same, (0, *same[1:])], plan=False)  # T may differ
    with pytest.raises(ValueError, match="max_tokens .* got rank 0: 5, rank 1: 0"):
        check_dispatch_agreement("moe_dispatch_plan", [same, (0, *same[1:])], plan=True)
    fp16 = (*same[:4], EP_DTYPES.index(torch.float16) + 1)
    with pytest.raises(ValueError, match="activation dtype .* got rank 0: bfloat16, rank 1: float16"):
        check_dispatch_agreement("moe_dispatch", [same, fp16], plan=False)


@pytest.mark.parametrize(
    ("dtype", "hidden", "top_k", "row_bytes"),
    [
        (torch.bfloat16, 2880, 4, 5792),
        (torch.bfloat16, 17, 3, 80),
        (torch.float16, 8, 1, 32),
        (torch.float32, 5, 8, 96),
    ],
)
def test_wire_rows_hold_activations_ids_and_weights_exactly(dtype, hidden, top_k, row_bytes):
    """ep_wire's row: activations, then the ids and weights at a 16-byte offset, rows a multiple
    of 16 bytes; the three views are disjoint and round-trip any bits, ids up to E included."""
    from tokenspeed_kernel.ops.moe.ep_wire import WireLayout

    layout = WireLayout(hidden, top_k, dtype)
    assert layout.row_bytes == row_bytes and layout.row_bytes % 16 == 0 and layout.meta_offset % 16 == 0
    assert layout.meta_offset >= hidden * dtype.itemsize and layout.meta_offset + 8 * top_k <= row_bytes
    g = torch.Generator().manual_seed(0)
    rows = 6
    wire = torch.zeros(rows, layout.row_bytes, dtype=torch.uint8)
    as_int = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    x = torch.randint(-(2**15), 2**15, (rows, hidden), generator=g, dtype=torch.int32).to(as_int).view(dtype)
    ids = torch.randint(0, 129, (rows, top_k), generator=g, dtype=torch.int32)
    ids[0] = 128  # the padding id E
    weights = torch.randn(rows, top_k, generator=g)
    weights[1] = torch.tensor([-0.0, 1e-42, float("inf"), float("nan"), 0.5, 2.0, -1.0, 3.0][:top_k])
    layout.act(wire).copy_(x)
    layout.ids(wire).copy_(ids)
    layout.weights(wire).copy_(weights)
    assert torch.equal(layout.act(wire).view(as_int), x.view(as_int))
    assert torch.equal(layout.ids(wire), ids)
    assert torch.equal(layout.weights(wire).view(torch.int32), weights.view(torch.int32))
    written = torch.zeros(layout.row_bytes, dtype=torch.int32)
    for view in (layout.act(wire[:1]), layout.ids(wire[:1]), layout.weights(wire[:1])):
        start = view.storage_offset() * view.element_size()
        written[start : start + view.shape[1] * view.element_size()] += 1
    assert int(written.max()) == 1, "the fields overlap"
    split = WireLayout(hidden, top_k, dtype, packed=False)  # the routing alone (large exchanges)
    assert split.meta_offset == 0 and split.row_bytes == -(-8 * top_k // 16) * 16
    meta = torch.zeros(rows, split.row_bytes, dtype=torch.uint8)
    split.ids(meta).copy_(ids)
    split.weights(meta).copy_(weights)
    assert torch.equal(split.ids(meta), ids) and torch.equal(
        split.weights(meta).view(torch.int32), weights.view(torch.int32)
    )
    with pytest.raises(ValueError, match="no activations"):
        split.act(meta)


def test_small_exchanges_are_packed_large_ones_split():
    from tokenspeed_kernel.ops.moe.ep_wire import PACK_BYTES, wire_layout

    row = 5792  # GPT-OSS: H = 2880 bf16, top-4
    assert wire_layout(2880, 4, torch.bfloat16, 2 * 64).packed  # EP=2, 64 tokens per rank: 0.7 MiB
    assert not wire_layout(2880, 4, torch.bfloat16, 2 * 4096).packed  # 4096 tokens: 45 MiB
    assert wire_layout(2880, 4, torch.bfloat16, PACK_BYTES // row).packed
    assert not wire_layout(2880, 4, torch.bfloat16, PACK_BYTES // row + 1).packed


def test_exchange_buffers_keep_the_returned_rows_zero_row_past_the_dispatch_bytes():
    """The receive arena: the dispatch's wire rows first, the combine's [W*C + 1, H] rows last,
    their last row zero and beyond every wire byte; a later step reuses the arena."""
    from tokenspeed_kernel.ops.moe.args import ExchangeBuffers
    from tokenspeed_kernel.ops.moe.ep_wire import WireLayout, recv_rows, returned_rows, send_rows

    cpu = torch.device("cpu")
    for dtype, hidden, top_k, rows in (
        (torch.bfloat16, 17, 3, 10),
        (torch.float32, 64, 4, 1),
        (torch.float16, 8, 1, 7),
    ):
        buffers = ExchangeBuffers()
        layout = WireLayout(hidden, top_k, dtype)
        send = send_rows(buffers, layout, rows, cpu)
        assert send.shape == (rows + 1, layout.row_bytes) and not bool(send.any())
        wire = recv_rows(buffers, layout, rows, cpu)
        wire.fill_(255)  # every byte a dispatch may write
        back = returned_rows(buffers, rows, hidden, dtype, cpu)
        assert back.shape == (rows + 1, hidden) and back.dtype == dtype
        assert (back.data_ptr() - buffers.recv.data_ptr()) % 16 == 0
        assert not bool(back[rows].view(torch.uint8).any()), "the zero row was written by the dispatch"
        back[:rows].fill_(1)
        assert recv_rows(buffers, layout, rows, cpu).data_ptr() == wire.data_ptr()
        assert send_rows(buffers, layout, rows, cpu) is send
        assert not bool(back[rows].view(torch.uint8).any())
    combine_only = ExchangeBuffers()  # a dispatch that keeps no wire rows (the reference)
    back = returned_rows(combine_only, 4, 8, torch.bfloat16, cpu)
    assert combine_only.recv.numel() == 5 * 8 * 2 and not bool(back[4].any())
