"""Platform detection, capability tables and the TOKENSPEED_KERNEL_PLATFORM override."""

import dataclasses

import pytest
import torch

from tokenspeed_kernel import config, platform


@pytest.fixture
def set_platform(monkeypatch):
    def _set(value):
        monkeypatch.setenv(config.PLATFORM_ENV, value)
        config.refresh()
        platform.refresh()
        return platform.current_platform()

    yield _set
    monkeypatch.delenv(config.PLATFORM_ENV, raising=False)
    config.refresh()
    platform.refresh()


@pytest.mark.parametrize(
    ("arch", "vendor", "has", "lacks"),
    [
        ("sm_80", "cuda", {"bf16", "cp_async"}, {"fp8_e4m3", "wgmma", "tma"}),
        ("sm_90", "cuda", {"bf16", "fp8_e4m3", "wgmma", "tma"}, {"tcgen05", "mxfp4_mma", "mfma"}),
        ("sm_100", "cuda", {"fp8_e4m3", "tma", "tcgen05", "mxfp4_mma"}, {"wgmma"}),
        ("gfx942", "rocm", {"mfma", "bf16", "fp8_e4m3fnuz"}, {"fp8_e4m3", "mxfp4_mma", "wgmma"}),
        ("gfx950", "rocm", {"mfma", "fp8_e4m3", "mxfp4_mma", "scaled_mfma"}, {"fp8_e4m3fnuz", "wgmma"}),
        ("cpu", "cpu", {"bf16", "fp16"}, {"mfma", "wgmma"}),
    ],
)
def test_override_gives_synthetic_platform(set_platform, arch, vendor, has, lacks):
    plat = set_platform(arch)
    assert (plat.vendor, plat.arch, plat.overridden) == (vendor, arch, True)
    assert has <= plat.capabilities
    assert not (lacks & plat.capabilities)
    assert plat.num_sms > 0 or arch == "cpu"


def test_override_applies_to_cpu_tensors_too(set_platform):
    plat = set_platform("gfx950")
    assert platform.platform_for(torch.device("cpu")) is plat


def test_unknown_override_is_a_clear_error(set_platform):
    with pytest.raises(ValueError, match="TOKENSPEED_KERNEL_PLATFORM='gfx1234' is not a known architecture"):
        set_platform("gfx1234")


def test_detection_without_override_on_this_machine():
    config.refresh()
    platform.refresh()
    plat = platform.current_platform()
    expected = "cpu" if not torch.cuda.is_available() else ("rocm" if torch.version.hip else "cuda")
    assert plat.vendor == expected and not plat.overridden
    assert platform.platform_for(torch.device("cpu")).vendor == "cpu"


def test_platform_is_immutable():
    plat = platform.platform_from_arch("sm_90")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plat.arch = "sm_100"  # type: ignore[misc]


def test_capabilities_for_unknown_arch_name():
    assert "wgmma" in platform.capabilities_for_arch("sm_90a")
    with pytest.raises(ValueError, match="unknown architecture"):
        platform.capabilities_for_arch("tpu_v5")


def test_cpu_line_gives_cores_and_ram(monkeypatch):
    monkeypatch.delenv(config.INTERPRETER_ENV, raising=False)  # the hardware's tags only
    monkeypatch.setattr(platform.os, "cpu_count", lambda: 6)
    monkeypatch.setattr(platform.os, "sysconf", lambda name: {"SC_PHYS_PAGES": 4 * 2**18, "SC_PAGE_SIZE": 4096}[name])
    cpu = platform._detect_cpu()
    assert cpu.memory_bytes == 4 * 2**30
    assert cpu.describe() == "cpu/cpu CPU: 6 cores, 4 GiB RAM, caps=bf16,fp16,fp64"
    gpu = platform.platform_from_arch("sm_90", overridden=False)
    assert gpu.describe().startswith("cuda/sm_90 NVIDIA H100 80GB HBM3: 132 SMs, 80 GiB, caps=")


@pytest.mark.parametrize(
    ("value", "on"),
    [("1", True), ("true", True), ("ON", True), ("yes", True), ("y", True), ("0", False), ("", False), (None, False)],
)
def test_the_cpu_reports_the_interpreter_while_triton_interpret_is_on(monkeypatch, value, on):
    """TRITON_INTERPRET, parsed as Triton parses it, gives every CPU platform (detected or
    synthetic) the capability ``triton_interpreter``; a GPU platform never has it."""
    if value is None:
        monkeypatch.delenv(config.INTERPRETER_ENV, raising=False)
    else:
        monkeypatch.setenv(config.INTERPRETER_ENV, value)
    tag = platform.INTERPRETER_CAPABILITY
    assert tag == "triton_interpreter" and config.interpreter_enabled() is on
    assert (tag in platform._detect_cpu().capabilities) is on
    assert (tag in platform.platform_from_arch("cpu").capabilities) is on
    assert tag not in platform.capabilities_for_arch("cpu")  # the hardware's table
    for arch in ("sm_80", "sm_90", "sm_100", "gfx942", "gfx950"):
        assert tag not in platform.platform_from_arch(arch).capabilities, arch


def test_the_interpreter_capability_is_read_at_detection(monkeypatch):
    """Detected once (cached with the platform); ``refresh`` reads the variable again."""
    monkeypatch.delenv(config.PLATFORM_ENV, raising=False)
    monkeypatch.delenv(config.INTERPRETER_ENV, raising=False)
    config.refresh()
    platform.refresh()
    try:
        before = platform.platform_for(torch.device("cpu"))
        monkeypatch.setenv(config.INTERPRETER_ENV, "1")
        assert platform.platform_for(torch.device("cpu")) is before  # cached: unchanged
        assert platform.INTERPRETER_CAPABILITY not in before.capabilities
        platform.refresh()
        assert platform.INTERPRETER_CAPABILITY in platform.platform_for(torch.device("cpu")).capabilities
    finally:
        monkeypatch.undo()
        config.refresh()
        platform.refresh()


def test_host_memory_falls_back_to_meminfo_then_unknown(monkeypatch, tmp_path):
    def no_sysconf(name):
        raise ValueError(f"unrecognized configuration name {name!r}")

    monkeypatch.setattr(platform.os, "sysconf", no_sysconf)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        2097152 kB\nMemFree:          1024 kB\n")
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda path, *a, **k: real_open(meminfo if path == "/proc/meminfo" else path, *a, **k)
    )
    assert platform._host_memory_bytes() == 2 * 2**30
    meminfo.unlink()
    assert platform._host_memory_bytes() == 0
    assert (
        platform._detect_cpu().describe().startswith("cpu/cpu CPU: ")
        and "? GiB RAM" in platform._detect_cpu().describe()
    )
