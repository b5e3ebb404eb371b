"""Environment switches of tokenspeed-kernel, read in one place.

Every variable the library honours is named here, with what it does:

``TOKENSPEED_KERNEL_PLATFORM``
    Pretend to run on another platform (``sm_90``, ``sm_100``, ``gfx942``, ``gfx950``,
    ``cpu``, ...). Selection, ``list`` and ``explain`` then answer for that platform, so
    selection can be tested on a CPU machine.
``TOKENSPEED_KERNEL_OVERRIDE``
    Force kernels per operator: ``"attention.decode=triton_decode,moe.apply=torch_moe"``.
    Checked against the registry on the first selection (``selector.env_overrides``).
``TOKENSPEED_KERNEL_DISABLE_BACKENDS``
    Comma-separated backend (entry-point) names not to load, e.g. ``"triton,nvidia"``;
    a name that matches no backend is logged as a warning once.
``TOKENSPEED_KERNEL_DEBUG``
    ``1`` turns on checks that need a device sync (page ids, slots, expert ids in range).
``TOKENSPEED_KERNEL_CAPTURE``
    A JSONL file; every public call appends its operator, kernel and argument signature
    once per distinct signature (see :mod:`tokenspeed_kernel.tools.capture`).

One variable of a compiler is read too: ``TRITON_INTERPRET`` (:func:`interpreter_enabled`).
While it turns Triton's CPU interpreter on, the CPU platform reports the capability
``triton_interpreter`` (:mod:`tokenspeed_kernel.platform`), which kernels written in Triton
require to serve CPU tensors; what is registered never depends on it. On a machine without a
CUDA or ROCm device, ``tokenspeed-kernel check`` sets it to ``1`` unless it is already set
(``TRITON_INTERPRET=0`` keeps it off), so the Triton kernels are checked under the interpreter
(:func:`use_cpu_interpreter`). The library itself never sets it.

Values are read when first needed and cached; :func:`refresh` re-reads them (tests).
"""

from __future__ import annotations

import functools
import os

PLATFORM_ENV = "TOKENSPEED_KERNEL_PLATFORM"
OVERRIDE_ENV = "TOKENSPEED_KERNEL_OVERRIDE"
DISABLE_BACKENDS_ENV = "TOKENSPEED_KERNEL_DISABLE_BACKENDS"
DEBUG_ENV = "TOKENSPEED_KERNEL_DEBUG"
CAPTURE_ENV = "TOKENSPEED_KERNEL_CAPTURE"
INTERPRETER_ENV = "TRITON_INTERPRET"
INTERPRETER_NOTE = (
    f"no GPU here: the Triton kernels run under Triton's CPU interpreter ({INTERPRETER_ENV}=1; "
    f"{INTERPRETER_ENV}=0 skips them)"
)

_TRUE = {"1", "true", "yes", "on"}
# Triton's own reading of a boolean variable (triton.knobs, 3.6): these, any case.
_TRITON_TRUE = {"1", "true", "yes", "on", "y"}


def env_flag(name: str) -> bool:
    """True when environment variable ``name`` is 1/true/yes/on (any case); read each call.
    The on/off switches of this package and of its backends all parse this way."""
    return os.environ.get(name, "").strip().lower() in _TRUE


@functools.cache
def platform_override() -> str | None:
    """The platform named by ``TOKENSPEED_KERNEL_PLATFORM``, or None."""
    value = os.environ.get(PLATFORM_ENV, "").strip()
    return value or None


@functools.cache
def kernel_overrides() -> dict[str, str]:
    """``{operator: kernel name}`` parsed from ``TOKENSPEED_KERNEL_OVERRIDE``."""
    raw = os.environ.get(OVERRIDE_ENV, "").strip()
    result: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        op, sep, name = item.partition("=")
        if not sep or not op.strip() or not name.strip():
            raise ValueError(f"{OVERRIDE_ENV}: expected 'operator=kernel' items separated by commas, got {item!r}")
        result[op.strip()] = name.strip()
    return result


@functools.cache
def disabled_backends() -> frozenset[str]:
    """Backend names listed in ``TOKENSPEED_KERNEL_DISABLE_BACKENDS``."""
    raw = os.environ.get(DISABLE_BACKENDS_ENV, "")
    return frozenset(name.strip() for name in raw.split(",") if name.strip())


@functools.cache
def debug() -> bool:
    """True when ``TOKENSPEED_KERNEL_DEBUG`` asks for synchronizing value checks."""
    return env_flag(DEBUG_ENV)


@functools.cache
def capture_path() -> str | None:
    """The JSONL file named by ``TOKENSPEED_KERNEL_CAPTURE``, or None."""
    value = os.environ.get(CAPTURE_ENV, "").strip()
    return value or None


def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` turns Triton's CPU interpreter on, read now and parsed as
    Triton parses it (``1``, ``true``, ``yes``, ``on``, ``y``; any case). The platform reads it
    when it detects the CPU platform (:func:`tokenspeed_kernel.platform.current_platform`)."""
    return os.environ.get(INTERPRETER_ENV, "").strip().lower() in _TRITON_TRUE


def use_cpu_interpreter() -> bool:
    """Run the Triton kernels on the CPU under Triton's interpreter: set ``TRITON_INTERPRET=1``
    when the user has not set it (to anything), triton is installed and torch sees no CUDA or
    ROCm device. Returns whether it was set. Must be called before the backends load and the
    platform is detected: Triton makes a kernel an interpreted one when its module is imported
    (``@triton.jit``), and the CPU platform's ``triton_interpreter`` capability is read when it
    is detected. The command line calls it for ``check``."""
    import importlib.util

    import torch

    if INTERPRETER_ENV in os.environ or importlib.util.find_spec("triton") is None or torch.cuda.is_available():
        return False
    os.environ[INTERPRETER_ENV] = "1"
    return True


def refresh() -> None:
    """Forget every cached value so the environment is read again."""
    for fn in (platform_override, kernel_overrides, disabled_backends, debug, capture_path):
        fn.cache_clear()
