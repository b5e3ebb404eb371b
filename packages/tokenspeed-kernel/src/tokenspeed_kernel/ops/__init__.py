"""Public operators, one sub-package per family: the API and its validation."""
