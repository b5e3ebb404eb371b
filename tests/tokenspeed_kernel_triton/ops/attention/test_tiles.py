"""The attention tile table keyed by vendor: the CUDA rows give the launches of the table
before it was keyed by vendor (measured on an H100), the interpreter uses them, every vendor
has every key, and the vendor comes from the tensor's device."""

import dataclasses
import itertools

import pytest
import torch

from tokenspeed_kernel.ops.attention.rows import QueryRows
from tokenspeed_kernel_triton.ops.attention import _launch
from tokenspeed_kernel_triton.ops.attention._common import HEAD_DIMS
from tokenspeed_kernel_triton.ops.attention._launch import VENDOR_TILES, Tile, _tile, kernel_config

# The table before it was keyed by vendor: regime (+ "_d256" when head_dim > 128, else
# "prefill_window" for a narrow window) -> (rows, block_n, num_warps, num_stages).
_BEFORE = {
    "prefill": (128, 64, 4, 3),
    "prefill_window": (64, 32, 4, 2),
    "prefill_d256": (64, 32, 8, 2),
    "decode": (16, 64, 4, 3),
    "decode_d256": (16, 32, 4, 2),
}


def _before(regime: str, head_dim: int, window: bool) -> Tile:
    if head_dim > 128:
        return Tile(*_BEFORE[f"{regime}_d256"])
    if regime == "prefill" and window:
        return Tile(*_BEFORE["prefill_window"])
    return Tile(*_BEFORE[regime])


@pytest.mark.parametrize("vendor", ["cuda", "cpu"])
def test_cuda_rows_give_the_launches_of_before(vendor):
    for regime, head_dim, window in itertools.product(("prefill", "decode"), HEAD_DIMS, (False, True)):
        assert _tile(regime, head_dim, window, vendor) == _before(regime, head_dim, window), (regime, head_dim)


def test_cuda_kernel_configs_unchanged():
    for regime, head_dim, window, group in itertools.product(("prefill", "decode"), HEAD_DIMS, (False, True), (1, 8)):
        common = dict(
            q_dtype=torch.bfloat16,
            num_q_heads=8 * group,
            num_kv_heads=8,
            head_dim=head_dim,
            head_dim_v=head_dim,
            max_q=1 if regime == "decode" else 4096,
            page_size=16,
            uniform_q=regime == "decode",
            causal=True,
            window=window,
            narrow_window=window,
            sinks=True,
            cap=False,
            scales=False,
            lse=True,
            splits=1,
            regime=regime,
        )
        default = kernel_config(**common)
        assert kernel_config(**common, vendor="cuda") == default
        assert kernel_config(**common, tile=_before(regime, head_dim, window)) == default
        # the interpreter (CPU tensors): the same launch with INTERPRET on; never on a GPU
        assert default.constexprs["INTERPRET"] is False
        assert kernel_config(**common, vendor="rocm").constexprs["INTERPRET"] is False
        interpreted = kernel_config(**common, vendor="cpu")
        assert interpreted == dataclasses.replace(default, constexprs={**default.constexprs, "INTERPRET": True})


def test_every_vendor_has_every_key():
    assert set(VENDOR_TILES) == {"cuda", "rocm", "cpu"}
    assert VENDOR_TILES["cpu"] is VENDOR_TILES["cuda"] is _launch.TILES
    assert set(VENDOR_TILES["rocm"]) == set(VENDOR_TILES["cuda"])


def test_rocm_rows_are_no_larger_than_cuda_rows():
    # Compile-only choices (zero spills on gfx942/gfx950): never bigger than the Hopper tile.
    for key, tile in VENDOR_TILES["rocm"].items():
        cuda = VENDOR_TILES["cuda"][key]
        assert tile.rows * tile.block_n <= cuda.rows * cuda.block_n * 2, key


def test_launch_reads_the_vendor_table(monkeypatch):
    # The launch path takes the vendor from q.device: on a (pretend) ROCm build the rocm rows.
    seen = []
    original = _launch.kernel_config

    def spy(**kwargs):
        seen.append(kwargs["vendor"])
        return original(**kwargs)

    monkeypatch.setattr(_launch, "kernel_config", spy)
    monkeypatch.setattr(_launch, "vendor_of", lambda device: "rocm")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(4, 2, 16, device=device)
    k = torch.randn(4, 1, 16, device=device)
    out = torch.empty_like(q)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=device)
    rows = QueryRows(
        q=q,
        k=k,
        v=k,
        out=out,
        lse=None,
        sinks=None,
        k_scale=None,
        v_scale=None,
        page_table=None,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        cache_seqlens=None,
        batch=1,
        max_q=4,
        max_k=4,
        q_len=0,
        causal=True,
        softmax_scale=0.25,
        window_left=-1,
        logit_cap=0.0,
    )
    _launch.launch(rows, splits=1, regime="prefill")
    assert seen == ["rocm"]
