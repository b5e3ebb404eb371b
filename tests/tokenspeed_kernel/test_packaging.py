"""Packaging promises: our modules come from packages/, the core names no vendor."""

import pathlib
import re

import tomllib

import tokenspeed_kernel

REPO = pathlib.Path(__file__).resolve().parents[2]
CORE = REPO / "packages" / "tokenspeed-kernel"


def test_imported_packages_live_under_packages_dir():
    # Same-named distributions on the public index belong to other projects; ours must be
    # the ones installed from this repository.
    import importlib.util

    for name in ("tokenspeed_kernel", "tokenspeed_kernel_triton", "tokenspeed_kernel_nvidia", "tokenspeed_kernel_amd"):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            # origin None: a namespace package, e.g. this repository's tests/<name>/ directory
            # found on sys.path when the wheel itself is not installed.
            print(f"{name}: not installed in this environment")
            continue
        origin = pathlib.Path(spec.origin).resolve()
        assert (REPO / "packages") in origin.parents, f"{name} imported from {origin}, not from {REPO / 'packages'}"
    assert (CORE / "src") in pathlib.Path(tokenspeed_kernel.__file__).resolve().parents


def test_core_depends_on_torch_only_and_pins_siblings_to_our_version():
    project = tomllib.loads((CORE / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == ["torch>=2.6"]
    version = project["version"]
    assert tokenspeed_kernel.__version__ == version
    for extra, reqs in project["optional-dependencies"].items():
        for req in reqs:
            assert req.endswith(f"=={version}"), f"extra {extra}: {req} must pin our own version {version}"
    for pkg in sorted((REPO / "packages").iterdir()):
        meta = tomllib.loads((pkg / "pyproject.toml").read_text())["project"]
        assert meta["version"] == version, f"{pkg.name} version {meta['version']} != {version}"


def test_core_source_names_no_vendor():
    pattern = re.compile(r"\b(triton|flashinfer|gluon|cudnn|nvidia|amd)\b", re.IGNORECASE)
    allowed = {"tools/baselines.py", "platform.py", "config.py"}  # device names, docs of env vars
    offenders = []
    for path in (CORE / "src" / "tokenspeed_kernel").rglob("*.py"):
        rel = path.relative_to(CORE / "src" / "tokenspeed_kernel").as_posix()
        if rel in allowed:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{rel}:{lineno}: {line.strip()}")
    assert not offenders, "vendor names in the core:\n" + "\n".join(offenders)
