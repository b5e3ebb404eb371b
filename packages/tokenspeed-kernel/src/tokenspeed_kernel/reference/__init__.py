"""The built-in reference backend: pure-PyTorch kernels for every operator.

Registered at the ``reference`` priority band; correct on CPU and GPU for every feature,
they are the numerics ground truth (run in float64 by the check tool) and the embedded
default on a machine with nothing else. Imported lazily by the registry on first selection.

One kernel here is not a reference: ``torch_moe_dispatch_padded`` (``moe_ep``, band
``opt_in``), the fixed-size expert-parallel exchange. It needs nothing but PyTorch and
``torch.distributed``, as the reference does, so it ships with the core rather than with a
vendor wheel.
"""

from tokenspeed_kernel.reference import attention, kvcache, moe, moe_ep  # noqa: F401  (registers)
