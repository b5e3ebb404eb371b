"""Gluon kernels, one module per kernel, mirroring ``tokenspeed_kernel.ops``."""
