"""KV-cache operators: ``store_kvcache``. Public API in :mod:`.api`, kernel contract in :mod:`.args`."""

from tokenspeed_kernel.ops.kvcache.api import store_kvcache

__all__ = ["store_kvcache"]
