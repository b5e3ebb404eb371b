"""Shared setup of the vLLM plugin tests: vLLM on the CPU, and one real ``VllmConfig``.

vLLM 0.33.0 is installed with ``--no-deps`` next to torch 2.13 (CPU) plus the pure-Python
packages in ``packages/tokenspeed-kernel-vllm/ci-requirements.txt``; ``vllm._C`` is absent
and nothing here needs it. Without a GPU vLLM is told it runs on the CPU platform
(``VLLM_TARGET_DEVICE=cpu``) before anything imports it; vLLM is imported when the first of
these tests runs. The tests skip, saying why, when vLLM cannot be imported.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from support.vllm_env import TINY_GPT_OSS, make_vllm_config

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session")
def _vllm_importable() -> None:
    """Import vLLM when the first plugin test runs, not at collection: importing it sets
    process-wide variables (TORCHINDUCTOR_COMPILE_THREADS, TORCHINDUCTOR_CACHE_DIR, ...) that
    the rest of the suite, collected first and run first, should not see."""
    try:
        import vllm.config  # noqa: F401
    except Exception as exc:  # any import failure means: not installed the way the tests need
        reason = (
            f"vllm is not importable ({type(exc).__name__}: {exc}); "
            "see packages/tokenspeed-kernel-vllm/README.md, 'CI install'"
        )
        print(f"\ntests/tokenspeed_kernel_vllm skipped: {reason}")
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def _needs_vllm(_vllm_importable: None) -> None:
    """Every test here needs vLLM (skipped, saying why, without it)."""


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny_gpt_oss")
    (path / "config.json").write_text(json.dumps(TINY_GPT_OSS))
    return str(path)


@pytest.fixture(scope="session")
def vllm_config(_vllm_importable: None, tiny_model_dir: str):
    return make_vllm_config(tiny_model_dir)
