"""KV-cache operators: ``store_kvcache``. Public API in :mod:`.api`, kernel contract in :mod:`.args`.

``store_request`` builds the selector request of a call from plain shapes.
"""

from tokenspeed_kernel.ops.kvcache.api import store_kvcache, store_request

__all__ = ["store_kvcache", "store_request"]
