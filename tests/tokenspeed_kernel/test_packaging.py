"""Packaging promises: our modules come from packages/, the core names no vendor, and the
README's commands are the ones CI runs."""

import pathlib
import re
import sys

import tokenspeed_kernel

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (our floor): pytest itself depends on tomli there
    import tomli as tomllib

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
        source = origin if (REPO / "packages") in origin.parents else _wheel_source(name)
        assert source is not None and REPO in source.parents, (
            f"{name} imported from {origin}: neither under {REPO / 'packages'} nor installed from a wheel built here"
        )


def _wheel_source(module: str) -> pathlib.Path | None:
    """The local wheel file a non-editable install of ``module``'s distribution came from (pip's
    direct_url.json, e.g. the `.whl/` the device scripts install), or None."""
    import importlib.metadata
    import json
    import urllib.parse

    try:
        dist = importlib.metadata.distribution(module.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return None
    raw = dist.read_text("direct_url.json")
    url = json.loads(raw).get("url", "") if raw else ""
    if not url.startswith("file://"):
        return None
    return pathlib.Path(urllib.parse.unquote(urllib.parse.urlparse(url).path)).resolve()


def test_core_depends_on_torch_only_and_pins_siblings_to_our_version():
    project = tomllib.loads((CORE / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == ["torch>=2.6"]
    version = project["version"]
    assert tokenspeed_kernel.__version__ == version
    # Third-party integrations and the plot extra: a lower bound on a library that does not pull torch.
    third_party = {"transformers": ["transformers>=5.0"], "plot": ["matplotlib>=3.5"]}
    for extra, reqs in project["optional-dependencies"].items():
        if extra in third_party:
            assert reqs == third_party[extra], f"extra {extra}: {reqs}"
            continue
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


def _bash_blocks(markdown: str) -> list[list[str]]:
    """The command lines of each fenced ```bash block."""
    return [
        [line.strip() for line in block.strip().splitlines() if line.strip()]
        for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.DOTALL)
    ]


def test_readme_commands_match_ci():
    """The README's quick start has the two commands of the issue (install + run the tools;
    run the tests), and ``.ci/run`` installs the same local wheels and runs that test command."""
    blocks = _bash_blocks((REPO / "README.md").read_text())
    first, tests = blocks[0], blocks[1]
    assert len(first) == 1 and "pip install -e packages/tokenspeed-kernel" in first[0]
    assert "tokenspeed-kernel list" in first[0] and "tokenspeed-kernel check" in first[0]
    test_command = tests[-1]
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert test_command in ci, f"{test_command!r} is not what .ci/run runs"
    ci_text = "\n".join(ci)
    for pkg in sorted(p.name for p in (REPO / "packages").iterdir()):
        assert f"-e packages/{pkg}" in ci_text, f".ci/run does not install {pkg} from its local path"
        assert f"-e packages/{pkg}" in "\n".join(first + tests), f"the README does not install {pkg}"
