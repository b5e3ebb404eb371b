"""Backend discovery through entry points: plugins win selection, broken ones are skipped.

Each test writes a ``*.dist-info`` with an ``entry_points.txt`` into a temporary directory
on ``sys.path``: importlib.metadata then discovers it exactly as it discovers an installed
wheel, so the real discovery path is exercised without pip.
"""

import dataclasses
import logging
import pathlib
import sys
import textwrap

import pytest
import torch

from tokenspeed_kernel import config, registry
from tokenspeed_kernel.cli import main
from tokenspeed_kernel.platform import platform_from_arch
from tokenspeed_kernel.registry import Request
from tokenspeed_kernel.selector import NOT_GRAPH_SAFE, explain

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE_SRC = REPO / "docs" / "examples" / "plugin" / "src"


def _fake_install(
    tmp_path: pathlib.Path, dist: str, entry_points: dict[str, str], modules: dict[str, str] | None = None
):
    info = tmp_path / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{lines}\n")
    for module, source in (modules or {}).items():
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(EXAMPLE_SRC))
    loaded_before = {b.name for b in registry.backends()}
    yield tmp_path
    for status in registry.backends():
        if status.name not in loaded_before:
            registry.unload_backend(status.name)
    for name in [m for m in sys.modules if m.startswith(("tokenspeed_kernel_example_plugin", "ts_"))]:
        del sys.modules[name]


DECODE = Request.make(
    "attention.decode",
    {"q": torch.float32, "kv": torch.float32},
    {"head_dim": 16, "head_dim_v": 16, "num_q_heads": 4, "num_kv_heads": 2, "page_size": 4, "q_len": 1},
    ["sliding_window"],
)


def test_backends_load_lazily_not_at_import():
    import subprocess

    code = (
        "import tokenspeed_kernel, tokenspeed_kernel.registry as r; "
        "print(len(r._backends)); tokenspeed_kernel.kernels(); print(len(r._backends) > 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "True"]


def test_backends_load_on_the_first_selection_once():
    import subprocess

    code = textwrap.dedent(
        """
        import sys
        import torch
        import tokenspeed_kernel
        from tokenspeed_kernel import registry
        assert not registry._backends and not registry._loaded
        assert not [m for m in sys.modules if m.startswith("tokenspeed_kernel_")], "a backend was imported"
        tokenspeed_kernel.moe_topk(torch.randn(3, 8), 2)  # the first selection loads every backend
        assert registry._loaded and registry._backends["reference"].state == "loaded"
        def again(*args, **kwargs):
            raise AssertionError("backends discovered a second time")
        registry._load_one = again
        tokenspeed_kernel.moe_topk(torch.randn(5, 8), 2)  # another request: selects, discovers nothing
        tokenspeed_kernel.kernels(), tokenspeed_kernel.backends()
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.split() == ["ok"], result.stderr


def test_example_plugin_is_discovered_and_wins(plugin_path):
    _fake_install(
        plugin_path, "tokenspeed_kernel_example_plugin", {"example": "tokenspeed_kernel_example_plugin:register"}
    )
    registry.load_backends(force=True)
    status = {b.name: b for b in registry.backends()}["example"]
    assert status.state == "loaded" and status.kernels == ["example_sdpa_decode"]
    cpu = platform_from_arch("cpu", overridden=False)
    assert explain(DECODE, platform=cpu).winner.name == "example_sdpa_decode"
    # A request it cannot serve falls back, with the plugin's reason shown.
    spec_decode = Request.make(
        "attention.decode", dict(DECODE.dtypes), {**dict(DECODE.shapes), "q_len": 3}, ["spec_decode"]
    )
    sel = explain(spec_decode, platform=cpu)
    assert sel.winner.name != "example_sdpa_decode"
    assert "does not support {spec_decode}" in sel.table()
    # It reads lengths on the host, says so, and is passed over for a CUDA-graph capture.
    capturable = dataclasses.replace(DECODE, capturable=True)
    cand = next(c for c in explain(capturable, platform=cpu).candidates if c.spec.name == "example_sdpa_decode")
    assert cand.reasons == (NOT_GRAPH_SAFE,)


def test_an_entry_point_naming_a_module_registers_on_import(plugin_path):
    _fake_install(
        plugin_path,
        "ts_module_plugin",
        {"module_form": "ts_module_plugin"},
        {
            "ts_module_plugin": """
            from tokenspeed_kernel.registry import Priority, register_kernel

            @register_kernel("moe.topk", name="module_form_topk", solution="test", priority=Priority.PLUGIN,
                             features=("softmax", "renormalize"))
            def topk(args):
                raise NotImplementedError
            """
        },
    )
    registry.load_backends(force=True)
    status = {b.name: b for b in registry.backends()}["module_form"]
    assert (status.state, status.target, status.kernels) == ("loaded", "ts_module_plugin", ["module_form_topk"])
    assert registry.get_kernel("module_form_topk").backend == "module_form"


def test_example_plugin_computes_decode(plugin_path):
    from support.naive_attention import naive_decode

    from tokenspeed_kernel import mha_decode_with_kvcache

    _fake_install(
        plugin_path, "tokenspeed_kernel_example_plugin", {"example": "tokenspeed_kernel_example_plugin:register"}
    )
    registry.load_backends(force=True)
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(9, 4, 2, 16, generator=gen)
    v_cache = torch.randn(9, 4, 2, 16, generator=gen)
    page_table = torch.randperm(9, generator=gen)[:8].view(2, 4).to(torch.int32)
    cache_seqlens = torch.tensor([13, 6], dtype=torch.int32)
    q = torch.randn(2, 4, 16, generator=gen)
    out = mha_decode_with_kvcache(q, k_cache, v_cache, page_table, cache_seqlens, 16, window_left=5)
    ref, _ = naive_decode(q, k_cache, v_cache, page_table, cache_seqlens, window_left=5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_example_plugin_proves_every_claim_of_its_registration(plugin_path):
    from tokenspeed_kernel.tools.numerics import check

    _fake_install(
        plugin_path, "tokenspeed_kernel_example_plugin", {"example": "tokenspeed_kernel_example_plugin:register"}
    )
    registry.load_backends(force=True)
    report = check("attention.decode", kernel="example_sdpa_decode", device="cpu", quiet=True)
    assert report.ok and report.claims
    assert {(c.claim, c.status) for c in report.claims if c.status != "checked"} == set()
    assert {c.claim for c in report.claims if c.kind == "feature"} == {"sliding_window"}


def test_failing_backend_is_skipped_and_rolled_back(plugin_path, caplog, capsys):
    _fake_install(
        plugin_path,
        "ts_broken_plugin",
        {"broken": "ts_broken_plugin"},
        {
            "ts_broken_plugin": """
            from tokenspeed_kernel.registry import register_kernel
            register_kernel("attention.decode", name="broken_half_registered", solution="test")(lambda args: None)
            raise ImportError("libmissing.so: cannot open shared object file")
            """
        },
    )
    with caplog.at_level(logging.WARNING, logger="tokenspeed_kernel"):
        registry.load_backends(force=True)
    status = {b.name: b for b in registry.backends()}["broken"]
    assert status.state == "failed" and "libmissing.so" in status.error
    assert "broken_half_registered" not in {k.name for k in registry.kernels()}
    assert "failed to load and is skipped" in caplog.text
    assert {b.name: b for b in registry.backends()}["reference"].state == "loaded"
    assert main(["list", "moe.topk"]) == 0  # the CLI names the failure and carries on
    out = capsys.readouterr().out
    assert "broken       failed    ts_broken_plugin: ImportError: libmissing.so" in out and "torch_moe_topk" in out


def test_disabled_backend_is_not_imported(plugin_path, env):
    _fake_install(
        plugin_path, "tokenspeed_kernel_example_plugin", {"example": "tokenspeed_kernel_example_plugin:register"}
    )
    env(config.DISABLE_BACKENDS_ENV, "example, other")
    registry.load_backends(force=True)
    status = {b.name: b for b in registry.backends()}["example"]
    assert status.state == "disabled" and "TOKENSPEED_KERNEL_DISABLE_BACKENDS" in status.error
    assert "tokenspeed_kernel_example_plugin" not in sys.modules
