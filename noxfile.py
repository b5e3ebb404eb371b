"""nox sessions, one per vendor, plus lint.

    nox -s tests    core + reference + Triton kernels under the interpreter + the GPT-OSS example (CPU)
    nox -s quick    every wheel's tests but those marked slow (tests/conftest.py), about a minute
    nox -s amd      AMD wheel: ahead-of-time gfx942/gfx950 compile-and-inspect tests (CPU);
                    numerics too when a ROCm GPU is present
    nox -s nvidia   NVIDIA wheel: registration, capability gating, sm_90 compile tests (CPU);
                    numerics too when a CUDA GPU is present
    nox -s gpu      the whole suite on a machine with a GPU (no interpreter), then
                    `tokenspeed-kernel check all` on the device
    nox -s lint     ruff check + ruff format --check, mypy over the core package

Every session installs torch FIRST (TORCH_SPEC, default torch==2.13.0, a CPU build on our
machines; set TORCH_SPEC=torch on a GPU machine to keep its CUDA/ROCm build), then our
wheels from their local paths: same-named distributions on the public index belong to
other projects and must never be resolved from there.
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"

TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
TRITON_SPEC = os.environ.get("TRITON_SPEC", "triton==3.6.0")
# The linters' versions, pinned: .pre-commit-config.yaml names the same ruff (test_packaging checks).
RUFF_VERSION = "0.17.6"
MYPY_VERSION = "2.4.1"
CORE = "packages/tokenspeed-kernel"
TRITON = "packages/tokenspeed-kernel-triton"
NVIDIA = "packages/tokenspeed-kernel-nvidia"
AMD = "packages/tokenspeed-kernel-amd"


def _install(session: nox.Session, *packages: str) -> None:
    session.install(TORCH_SPEC)
    # numpy 2.4 breaks the Triton 3.6 interpreter; hatchling builds the wheels in test_packaging
    session.install(TRITON_SPEC, "numpy<2.4", "pytest", "hatchling")
    for package in (CORE, *packages):
        if os.path.isdir(package):
            session.install("--no-deps", "-e", package)
        else:
            session.log(f"{package} is not in this checkout yet; skipping its install")


def _require(session: nox.Session, package: str) -> None:
    if not os.path.isdir(package):
        session.skip(f"{package} does not exist in this checkout yet")


@nox.session
def tests(session: nox.Session) -> None:
    """Core, reference backend, Triton kernels (interpreter) and the GPT-OSS example on CPU."""
    _install(session, TRITON)
    session.run(
        "pytest", "tests/tokenspeed_kernel", "tests/tokenspeed_kernel_triton", "tests/examples", *session.posargs
    )


@nox.session
def quick(session: nox.Session) -> None:
    """The quick subset of every wheel's CPU tests (pytest -m "not slow"): about a minute on 2 cores."""
    _install(session, TRITON, NVIDIA, AMD)
    session.run("pytest", "-m", "not slow", *session.posargs)


@nox.session
def amd(session: nox.Session) -> None:
    """The AMD wheel's tests: compile-and-inspect for gfx942/gfx950; numerics on ROCm GPUs."""
    _require(session, AMD)
    _install(session, TRITON, AMD)
    session.run("pytest", "tests/tokenspeed_kernel_amd", *session.posargs)


@nox.session
def nvidia(session: nox.Session) -> None:
    """The NVIDIA wheel's tests: registration, gating, sm_90 compile; numerics on CUDA GPUs."""
    _require(session, NVIDIA)
    _install(session, TRITON, NVIDIA)
    session.run("pytest", "tests/tokenspeed_kernel_nvidia", *session.posargs)


@nox.session
def gpu(session: nox.Session) -> None:
    """The whole suite on a GPU machine, in shards, then `tokenspeed-kernel check all` on it.

    Set TORCH_SPEC=torch to keep the machine's accelerator build of torch; the shards are
    ci/device/gpu_suite.sh's (SHARDS, SHARD_S, WORKERS)."""
    _install(session, TRITON, NVIDIA, AMD)
    session.install("pytest-xdist")
    session.run("bash", "ci/device/gpu_suite.sh", env={"INSTALL": "0"}, external=True)
    session.run("tokenspeed-kernel", "check", "all", "--device", "cuda")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the repository, then mypy over the core package
    (configured in pyproject.toml: [tool.mypy]; it reads torch's annotations, so torch goes in
    first, as everywhere)."""
    session.install(f"ruff=={RUFF_VERSION}")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.install(TORCH_SPEC)
    session.install(f"mypy=={MYPY_VERSION}", "numpy<2.4")
    session.install("--no-deps", "-e", CORE)
    session.run("mypy")
