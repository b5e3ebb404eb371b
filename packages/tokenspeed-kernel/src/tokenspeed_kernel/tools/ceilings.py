"""The device's own ceilings, measured once and cached: copy bandwidth and bf16 matmul rate.

Copy bandwidth counts bytes read plus bytes written by a large device-to-device copy; the
matmul rate is ``2·n³`` FLOPs of a large bf16 matmul over its median time. Results are
cached in ``$TOKENSPEED_KERNEL_CACHE_DIR/ceilings.json`` (default
``~/.cache/tokenspeed_kernel``) keyed by device name and torch version.
"""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import asdict, dataclass

import torch

from tokenspeed_kernel.tools.timing import time_fn

__all__ = ["Ceilings", "cache_dir", "ceilings"]

CACHE_DIR_ENV = "TOKENSPEED_KERNEL_CACHE_DIR"


@dataclass(frozen=True)
class Ceilings:
    device: str
    copy_tb_s: float
    matmul_tflop_s: float


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get(CACHE_DIR_ENV) or pathlib.Path.home() / ".cache" / "tokenspeed_kernel")


def _measure(device: torch.device) -> tuple[float, float]:
    gpu = device.type == "cuda"
    nbytes = (1 << 30) if gpu else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    copy_ms = time_fn(lambda: dst.copy_(src), device, graph=False).median_ms
    n = 8192 if gpu else 512
    dtype = torch.bfloat16 if gpu else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_ms = time_fn(lambda: a @ b, device, graph=False).median_ms
    return 2 * nbytes / copy_ms / 1e9, 2 * n**3 / mm_ms / 1e9


def ceilings(device: torch.device) -> Ceilings:
    """Measured (or cached) ceilings of ``device``."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    key = f"{name}|torch {torch.__version__}"
    path = cache_dir() / "ceilings.json"
    table = json.loads(path.read_text()) if path.exists() else {}
    if key in table:
        return Ceilings(**table[key])
    copy_tb_s, matmul_tflop_s = _measure(device)
    result = Ceilings(name, copy_tb_s, matmul_tflop_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    table[key] = asdict(result)
    path.write_text(json.dumps(table, indent=2, sort_keys=True))
    return result
