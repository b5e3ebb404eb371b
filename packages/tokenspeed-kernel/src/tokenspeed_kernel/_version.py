"""The version of every tokenspeed-kernel wheel, written here only: each wheel's build reads it
(``[tool.hatch.version]`` in its pyproject.toml), and the sibling pins must name it
(tests/tokenspeed_kernel/test_packaging.py; CHANGELOG.md, "Versioning")."""

__version__ = "2026.11.0"
