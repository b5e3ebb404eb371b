"""NVIDIA kernels, mirroring the core ``ops/<family>`` layout."""
