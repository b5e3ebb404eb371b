"""The public kit for backend wheels (tokenspeed_kernel.kit): what each helper answers, and
that the core stays torch-only and vendor-neutral."""

from __future__ import annotations

import ast
import pathlib
import types

import pytest
import torch

from tokenspeed_kernel import kit, operators
from tokenspeed_kernel.registry import Request


def test_cdiv_and_next_pow2_match_triton():
    triton = pytest.importorskip("triton", reason="the comparison needs triton installed")
    for n in range(1, 3000):
        assert kit.next_pow2(n) == triton.next_power_of_2(n)
    for a in range(-40, 200):
        for b in range(1, 33):
            assert kit.cdiv(a, b) == triton.cdiv(a, b)


def test_next_pow2_edges():
    assert [kit.next_pow2(n) for n in (-5, 0, 1, 2, 3, 4, 5, 1023, 1024, 1025)] == [
        1,
        1,
        1,
        2,
        4,
        4,
        8,
        1024,
        1024,
        2048,
    ]
    assert kit.next_pow2(True) == 1 and kit.next_pow2(torch.tensor(9).item()) == 16
    assert kit.cdiv(0, 7) == 0 and kit.cdiv(-1, 4) == 0 and kit.cdiv(2**40 + 1, 2**20) == 2**20 + 1
    with pytest.raises(ZeroDivisionError):
        kit.cdiv(1, 0)


def test_vendor_of_device(monkeypatch):
    assert kit.vendor_of(torch.device("cpu")) == "cpu"
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert kit.vendor_of(torch.device("cuda", 0)) == "cuda"
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    assert kit.vendor_of(torch.device("cuda", 0)) == "rocm"  # a ROCm build reports device.type "cuda"
    assert kit.vendor_of(torch.device("cpu")) == "cpu"


def test_sm_count_queries_each_gpu_once_and_defaults_elsewhere(monkeypatch):
    calls = []

    def props(index):
        calls.append(index)
        return types.SimpleNamespace(multi_processor_count=100 + index)

    kit._multiprocessors.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    try:
        assert kit.sm_count(torch.device("cpu")) == 1
        assert kit.sm_count(torch.device("cpu"), default=132) == 132
        assert kit.sm_count(torch.device("meta"), default=7) == 7
        assert kit.sm_count(torch.device("cuda", 0)) == 100
        assert kit.sm_count(torch.device("cuda", 0)) == 100
        assert kit.sm_count(torch.device("cuda")) == 101  # no index: the current device
        assert kit.sm_count(torch.device("cuda", 1), default=5) == 101  # default is only for non-GPU devices
        assert calls == [0, 1]  # cached per index
    finally:
        kit._multiprocessors.cache_clear()


@pytest.mark.parametrize("programs", [-3, 0, 1, 2, 7, 64, 263, 264, 265, 10_000])
@pytest.mark.parametrize("num_sms", [1, 132, 304])
@pytest.mark.parametrize("most", [0, 1, 3, 64])
@pytest.mark.parametrize("per_sm", [1, 2, 8])
def test_fill_splits_against_its_definition(programs, num_sms, most, per_sm):
    got = kit.fill_splits(programs, num_sms, most=most, per_sm=per_sm)
    want = -(-(per_sm * num_sms) // max(programs, 1))  # ceil, in exact integers
    assert got == max(1, min(want, most))
    assert 1 <= got <= max(most, 1)
    if 1 <= got < most:  # not clamped: the grid just reaches per_sm programs per SM
        assert max(programs, 1) * got >= per_sm * num_sms > max(programs, 1) * (got - 1)


def test_fill_splits_serves_the_decode_heuristics():
    # Triton decode (H100: 132 SMs, 256 keys per split at least, 64 at most) and the Gluon decode.
    from_triton = kit.fill_splits(1 * 8, 132, most=min(8192 // 256, 64))
    assert from_triton == 32
    assert kit.fill_splits(256 * 8, 132, most=64) == 1
    assert kit.fill_splits(3, 132, most=2) == 2


def test_activation_codes_cover_the_operator_vocabulary_and_are_read_only():
    moe_features = set(operators.operator_schema("moe.apply").features)
    assert set(kit.ACTIVATION_CODES) <= moe_features
    assert dict(kit.ACTIVATION_CODES) == {"silu": 0, "gelu": 1, "swiglu_oai": 2}  # the kernels hard-code these
    with pytest.raises(TypeError):
        kit.ACTIVATION_CODES["relu"] = 3  # type: ignore[index]


def test_equal_head_dims():
    def req(**shapes):
        return Request.make("attention.decode", shapes=shapes)

    assert kit.equal_head_dims(req(head_dim=128, head_dim_v=128)) is None
    assert kit.equal_head_dims(req(head_dim=128)) is None  # left out: passes
    assert kit.equal_head_dims(req()) is None
    assert kit.equal_head_dims(req(head_dim=192, head_dim_v=128)) == "head_dim_v=128 differs from head_dim=192"


def test_kit_is_torch_only_and_names_no_backend():
    source = pathlib.Path(kit.__file__).read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "functools", "types", "torch", "tokenspeed_kernel"}, imported
    lowered = source.lower()
    for word in ("nvidia", "amd", "triton_", "tokenspeed_kernel_", "flashinfer", "gluon", "hopper", "cdna"):
        assert word not in lowered, word
    assert all(callable(getattr(kit, name)) or name == "ACTIVATION_CODES" for name in kit.__all__)
