"""Shared test helpers: independent float64 computations and input builders."""
