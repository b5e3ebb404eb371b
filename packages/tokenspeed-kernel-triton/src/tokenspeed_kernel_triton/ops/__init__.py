"""Triton kernels, one sub-package per operator family."""
