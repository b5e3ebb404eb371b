"""The built-in reference backend: pure-PyTorch kernels for every operator.

Registered at the ``reference`` priority band; correct on CPU and GPU for every feature,
they are the numerics ground truth (run in float64 by the check tool) and the embedded
default on a machine with nothing else. Imported lazily by the registry on first selection.
"""

from tokenspeed_kernel.reference import attention, kvcache, moe  # noqa: F401  (registers)
