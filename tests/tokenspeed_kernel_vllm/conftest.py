"""Shared setup of the vLLM plugin tests: vLLM on the CPU, and one real ``VllmConfig``.

vLLM 0.33.0 is installed with ``--no-deps`` next to torch 2.13 (CPU) plus the pure-Python
packages in ``packages/tokenspeed-kernel-vllm/ci-requirements.txt``; ``vllm._C`` is absent
and nothing here needs it. Without a GPU vLLM is told it runs on the CPU platform
(``VLLM_TARGET_DEVICE=cpu``) before anything imports it. The tests skip, saying why, when
vLLM cannot be imported.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

try:
    import vllm.config  # noqa: F401

    VLLM_ERROR: str | None = None
except Exception as exc:  # any import failure means: not installed the way the tests need
    VLLM_ERROR = f"{type(exc).__name__}: {exc}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if VLLM_ERROR is None:
        return
    reason = f"vllm is not importable ({VLLM_ERROR}); see packages/tokenspeed-kernel-vllm/README.md, 'CI install'"
    print(f"\ntests/tokenspeed_kernel_vllm skipped: {reason}")
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=reason))


from support.vllm_env import TINY_GPT_OSS, make_vllm_config  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny_gpt_oss")
    (path / "config.json").write_text(json.dumps(TINY_GPT_OSS))
    return str(path)


@pytest.fixture(scope="session")
def vllm_config(tiny_model_dir: str):
    return make_vllm_config(tiny_model_dir)
