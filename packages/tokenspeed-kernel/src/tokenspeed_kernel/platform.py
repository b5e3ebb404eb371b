"""What hardware we run on: one immutable :class:`Platform`, detected through torch.

Everything the selector knows about the hardware is here. Capability tags are derived from
the architecture through the tables below (data, not branches), so a kernel declares
``capabilities=("wgmma",)`` instead of testing compute capabilities itself.

``TOKENSPEED_KERNEL_PLATFORM=gfx950`` (or ``sm_90``, ``sm_100``, ``cpu``, ...) replaces
detection with a synthetic platform for that architecture, so selection for any platform
can be exercised on a CPU-only machine.

One capability comes from the process, not the hardware: a CPU platform (detected or
synthetic) reports :data:`INTERPRETER_CAPABILITY` (``triton_interpreter``) while
``TRITON_INTERPRET`` turns Triton's CPU interpreter on (:func:`config.interpreter_enabled`,
read when the platform is detected; :func:`refresh` re-reads it). Kernels written in Triton
register for the CPU always and require it there, so what is registered never depends on the
environment; a GPU platform never reports it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch

from tokenspeed_kernel import config

__all__ = [
    "INTERPRETER_CAPABILITY",
    "KNOWN_ARCHS",
    "ArchInfo",
    "Platform",
    "capabilities_for_arch",
    "current_platform",
    "platform_for",
    "platform_from_arch",
]

Vendor = str  # "cuda" | "rocm" | "cpu"


@dataclass(frozen=True)
class Platform:
    """An immutable description of one device.

    Attributes:
        vendor: ``"cuda"`` (NVIDIA), ``"rocm"`` (AMD) or ``"cpu"``.
        arch: ``"sm_90"``, ``"sm_100"``, ``"gfx942"``, ``"gfx950"``, ... or ``"cpu"``.
        name: the device name torch reports (or a synthetic one for an override).
        num_sms: streaming multiprocessors / compute units (CPU: logical cores).
        memory_bytes: device memory in bytes (CPU: the machine's RAM; 0 when unknown).
        capabilities: tags such as ``bf16``, ``fp8_e4m3``, ``wgmma``, ``tma``, ``mfma``,
            ``mxfp4_mma`` that kernels may require (a CPU platform: ``triton_interpreter``
            while Triton's interpreter is on).
        overridden: True when the platform came from ``TOKENSPEED_KERNEL_PLATFORM``.
    """

    vendor: Vendor
    arch: str
    name: str
    num_sms: int
    memory_bytes: int
    capabilities: frozenset[str] = field(default_factory=frozenset)
    overridden: bool = False

    def describe(self) -> str:
        """One line: ``cuda/sm_90 NVIDIA H100 80GB HBM3: 132 SMs, 80 GiB, caps=...``; on a CPU
        ``cpu/cpu CPU: 8 cores, 31 GiB RAM, caps=...`` (``?`` for what is unknown)."""
        caps = ",".join(sorted(self.capabilities))
        mem = f"{self.memory_bytes / 2**30:.0f} GiB" if self.memory_bytes else "? GiB"
        units = self.num_sms or "?"
        size = f"{units} cores, {mem} RAM" if self.vendor == "cpu" else f"{units} SMs, {mem}"
        origin = " (override)" if self.overridden else ""
        return f"{self.vendor}/{self.arch} {self.name}{origin}: {size}, caps={caps}"


@dataclass(frozen=True)
class ArchInfo:
    """Facts about an architecture, used for capability lookup and for overrides."""

    vendor: Vendor
    example_device: str
    num_sms: int
    memory_gib: int


# Architectures with a known example device; an override must name one of these.
KNOWN_ARCHS: dict[str, ArchInfo] = {
    "cpu": ArchInfo("cpu", "CPU", 0, 0),
    "sm_80": ArchInfo("cuda", "NVIDIA A100-SXM4-80GB", 108, 80),
    "sm_86": ArchInfo("cuda", "NVIDIA RTX A6000", 84, 48),
    "sm_89": ArchInfo("cuda", "NVIDIA L40S", 142, 48),
    "sm_90": ArchInfo("cuda", "NVIDIA H100 80GB HBM3", 132, 80),
    "sm_100": ArchInfo("cuda", "NVIDIA B200", 148, 180),
    "sm_120": ArchInfo("cuda", "NVIDIA RTX PRO 6000", 188, 96),
    "gfx90a": ArchInfo("rocm", "AMD Instinct MI250X", 110, 64),
    "gfx942": ArchInfo("rocm", "AMD Instinct MI300X", 304, 192),
    "gfx950": ArchInfo("rocm", "AMD Instinct MI355X", 256, 288),
}

# NVIDIA capability tags: (tag, first compute capability, last compute capability or None).
_CUDA_CAPABILITIES: tuple[tuple[str, int, int | None], ...] = (
    ("fp16", 70, None),
    ("bf16", 80, None),
    ("tf32", 80, None),
    ("cp_async", 80, None),
    ("fp8_e4m3", 89, None),
    ("tma", 90, None),
    ("wgmma", 90, 90),
    ("tcgen05", 100, 110),
    ("mxfp4_mma", 100, None),
)

# AMD capability tags per architecture.
_ROCM_CAPABILITIES: dict[str, frozenset[str]] = {
    "gfx90a": frozenset({"fp16", "bf16", "mfma"}),
    "gfx942": frozenset({"fp16", "bf16", "mfma", "fp8_e4m3fnuz"}),
    "gfx950": frozenset({"fp16", "bf16", "mfma", "fp8_e4m3", "mxfp4_mma", "scaled_mfma"}),
}

_CPU_CAPABILITIES = frozenset({"fp16", "bf16", "fp64"})

# Reported by a CPU platform while Triton's CPU interpreter is on (config.interpreter_enabled):
# Triton kernels then run on CPU tensors. Read when the platform is detected, never by a GPU.
INTERPRETER_CAPABILITY = "triton_interpreter"


def _process_capabilities(vendor: Vendor) -> frozenset[str]:
    """The tags a platform of ``vendor`` owes to this process rather than its hardware."""
    on = vendor == "cpu" and config.interpreter_enabled()
    return frozenset({INTERPRETER_CAPABILITY}) if on else frozenset()


def capabilities_for_arch(arch: str) -> frozenset[str]:
    """Capability tags of an architecture name (``sm_90``, ``gfx950``, ``cpu``): the hardware's,
    from the tables (a platform adds :data:`INTERPRETER_CAPABILITY` on the CPU, see above)."""
    if arch == "cpu":
        return _CPU_CAPABILITIES
    if arch.startswith("sm_"):
        digits = "".join(ch for ch in arch[3:] if ch.isdigit())
        cc = int(digits) if digits else 0
        return frozenset(tag for tag, first, last in _CUDA_CAPABILITIES if cc >= first and (last is None or cc <= last))
    if arch.startswith("gfx"):
        return _ROCM_CAPABILITIES.get(arch, frozenset({"fp16", "mfma"}))
    raise ValueError(f"unknown architecture {arch!r}; expected 'cpu', 'sm_NN' or 'gfxNNN'")


def platform_from_arch(arch: str, *, overridden: bool = True) -> Platform:
    """A synthetic platform for ``arch`` (used by ``TOKENSPEED_KERNEL_PLATFORM``)."""
    arch = arch.strip().lower()
    if arch not in KNOWN_ARCHS:
        raise ValueError(
            f"{config.PLATFORM_ENV}={arch!r} is not a known architecture; "
            f"expected one of {', '.join(sorted(KNOWN_ARCHS))}"
        )
    info = KNOWN_ARCHS[arch]
    return Platform(
        vendor=info.vendor,
        arch=arch,
        name=info.example_device,
        num_sms=info.num_sms,
        memory_bytes=info.memory_gib * 2**30,
        capabilities=capabilities_for_arch(arch) | _process_capabilities(info.vendor),
        overridden=overridden,
    )


def _host_memory_bytes() -> int:
    """Physical memory of this machine in bytes, without dependencies: ``os.sysconf`` (POSIX),
    else ``MemTotal`` of ``/proc/meminfo`` (Linux), else 0 (unknown)."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        if pages > 0 and page_size > 0:
            return pages * page_size
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows) or no such name
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _detect_cpu() -> Platform:
    return Platform(
        vendor="cpu",
        arch="cpu",
        name="CPU",
        num_sms=os.cpu_count() or 1,
        memory_bytes=_host_memory_bytes(),
        capabilities=_CPU_CAPABILITIES | _process_capabilities("cpu"),
    )


def _detect_gpu() -> Platform | None:
    if not torch.cuda.is_available():
        return None
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    if getattr(torch.version, "hip", None):
        arch = str(getattr(props, "gcnArchName", "gfx")).split(":")[0]
        vendor: Vendor = "rocm"
    else:
        arch = f"sm_{props.major}{props.minor}"
        vendor = "cuda"
    return Platform(
        vendor=vendor,
        arch=arch,
        name=props.name,
        num_sms=props.multi_processor_count,
        memory_bytes=props.total_memory,
        capabilities=capabilities_for_arch(arch),
    )


@functools.cache
def current_platform() -> Platform:
    """The platform of the current device (the override when one is set). Cached."""
    override = config.platform_override()
    if override is not None:
        return platform_from_arch(override)
    return _detect_gpu() or _detect_cpu()


@functools.cache
def _cpu_platform() -> Platform:
    return _detect_cpu()


def platform_for(device: torch.device) -> Platform:
    """The platform that serves tensors on ``device``.

    CPU tensors are served by the CPU platform even on a GPU machine, unless an override
    is set (then the override answers for every device, which is what selection tests want).
    """
    if device.type == "cpu" and config.platform_override() is None:
        return _cpu_platform()
    return current_platform()


def refresh() -> None:
    """Forget the detected platform (after changing ``TOKENSPEED_KERNEL_PLATFORM`` or
    ``TRITON_INTERPRET``)."""
    current_platform.cache_clear()
    _cpu_platform.cache_clear()
