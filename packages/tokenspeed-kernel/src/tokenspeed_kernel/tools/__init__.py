"""Tools for kernel authors: numerics checks, benchmarks, profiling, shape capture/replay."""
