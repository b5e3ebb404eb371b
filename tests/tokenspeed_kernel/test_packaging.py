"""Packaging promises: our modules come from packages/, the core names no vendor, and the
README's commands are the ones CI runs."""

import importlib
import importlib.metadata
import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest

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


VERSION_FILE = CORE / "src" / "tokenspeed_kernel" / "_version.py"
PYPROJECTS = sorted((REPO / "packages").glob("*/pyproject.toml"))
PLUGIN_EXAMPLE = REPO / "docs" / "examples" / "plugin" / "pyproject.toml"


def _toml(path: pathlib.Path) -> dict:
    return tomllib.loads(path.read_text())


def _source_version() -> str:
    """The one version of every wheel, as written in the core's ``_version.py``."""
    (version,) = re.findall(r'^__version__ = "([^"]+)"$', VERSION_FILE.read_text(), flags=re.MULTILINE)
    return version


def _sibling_pins(path: pathlib.Path) -> list[tuple[str, str, str]]:
    """``(group, name, specifier)`` of every requirement of ``path``'s project on one of our
    wheels: its dependencies and each extra."""
    from packaging.requirements import Requirement

    project = _toml(path)["project"]
    groups = {"dependencies": project.get("dependencies", [])}
    groups |= {f"extra {name}": reqs for name, reqs in project.get("optional-dependencies", {}).items()}
    pins = []
    for group, reqs in groups.items():
        for req in map(Requirement, reqs):
            if req.name.startswith("tokenspeed-kernel"):
                pins.append((group, req.name, str(req.specifier)))
    return pins


def test_core_depends_on_torch_only():
    project = _toml(CORE / "pyproject.toml")["project"]
    assert project["dependencies"] == ["torch>=2.6"]
    # Third-party integrations and the plot extra: a lower bound on a library that does not pull torch.
    third_party = {"transformers": ["transformers>=5.0"], "plot": ["matplotlib>=3.5"]}
    for extra, reqs in project["optional-dependencies"].items():
        if extra in third_party:
            assert reqs == third_party[extra], f"extra {extra}: {reqs}"
        else:
            assert all(req.startswith("tokenspeed-kernel-") for req in reqs), f"extra {extra}: {reqs}"


def test_every_wheel_reads_the_one_version_source():
    """Each wheel's version is dynamic, read by hatch from the core's ``_version.py``; the
    modules report the same version."""
    version = _source_version()
    assert tokenspeed_kernel.__version__ == version
    assert len(PYPROJECTS) == 5, [p.parent.name for p in PYPROJECTS]
    for path in PYPROJECTS:
        data = _toml(path)
        name = path.parent.name
        assert "version" not in data["project"] and "version" in data["project"].get("dynamic", []), name
        source = path.parent / data["tool"]["hatch"]["version"]["path"]
        assert source.resolve() == VERSION_FILE.resolve(), f"{name} reads its version from {source}"
    vllm_plugin = importlib.util.find_spec("tokenspeed_kernel_vllm")
    if vllm_plugin is None or vllm_plugin.origin is None:
        print("tokenspeed_kernel_vllm: not importable here; its __version__ is not checked")
    else:
        assert importlib.import_module("tokenspeed_kernel_vllm").__version__ == version


def test_hatch_resolves_every_wheel_to_the_version():
    """What a build writes into the wheels' metadata: hatch's own resolution of each project."""
    pytest.importorskip("hatchling", reason="the wheels build with hatchling: pip install hatchling")
    from hatchling.metadata.core import ProjectMetadata
    from hatchling.plugin.manager import PluginManager

    version = _source_version()
    for path in PYPROJECTS:
        assert ProjectMetadata(str(path.parent), PluginManager()).version == version, path.parent.name


def test_every_sibling_pin_names_the_version():
    """The exact pins between our wheels stay (same-named distributions on the public index
    belong to other projects: an exact pin makes pip fail rather than take one), and each
    names the one version; so does the example plugin's pin on the core."""
    version = _source_version()
    ours = {path.parent.name for path in PYPROJECTS}
    pins = [(path, *pin) for path in [*PYPROJECTS, PLUGIN_EXAMPLE] for pin in _sibling_pins(path)]
    # the core's extras (6 pins), the Triton wheel (1), NVIDIA and AMD (2 each), vLLM plugin and example (1 each)
    assert len(pins) >= 13, pins
    wrong = [
        f"{path.relative_to(REPO)} {group}: {name}{spec}"
        for path, group, name, spec in pins
        if name not in ours or spec != f"=={version}"
    ]
    assert not wrong, f"pins that are not =={version} on one of {sorted(ours)}:\n" + "\n".join(wrong)


def test_license_is_apache_2_everywhere():
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    for path in PYPROJECTS:
        assert _toml(path)["project"]["license"] == "Apache-2.0", path.parent.name
        # hatchling ships a project's LICENSE* in the wheel's dist-info/licenses: each wheel
        # directory carries the same text as the repository's.
        assert (path.parent / "LICENSE").read_text() == text, f"{path.parent.name}/LICENSE differs from LICENSE"


def test_linter_versions_agree():
    """One ruff (and one mypy) for nox, CI and pre-commit."""
    noxfile = (REPO / "noxfile.py").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    precommit = (REPO / ".pre-commit-config.yaml").read_text()
    (ruff,) = re.findall(r'^RUFF_VERSION = "([^"]+)"$', noxfile, flags=re.MULTILINE)
    (mypy,) = re.findall(r'^MYPY_VERSION = "([^"]+)"$', noxfile, flags=re.MULTILINE)
    assert re.findall(r"\bruff==(\S+)", ci) == [ruff]
    assert re.findall(r"\bmypy==(\S+)", ci) == [mypy]
    assert re.findall(r"astral-sh/ruff-pre-commit\s+rev: v(\S+)", precommit) == [ruff]


def test_runtime_wheels_hold_no_dev_tooling():
    """The ahead-of-time compile-and-inspect tooling lives in ci/tokenspeed_kernel_dev (tests and
    CI import it); no wheel ships a copy or imports it."""
    dev = re.compile(r"^\s*(from|import)\s+tokenspeed_kernel_dev\b", re.MULTILINE)
    offenders = []
    for path in sorted((REPO / "packages").glob("*/src/**/*.py")):
        rel = path.relative_to(REPO / "packages").as_posix()
        if dev.search(path.read_text()):
            offenders.append(f"{rel}: imports tokenspeed_kernel_dev")
        if re.fullmatch(r"_?(aot|\w*_aot|aot_common)\.py", path.name):
            offenders.append(f"{rel}: an AOT tooling module inside a wheel")
    assert not offenders, "\n".join(offenders)
    assert (REPO / "ci" / "tokenspeed_kernel_dev" / "aot_common.py").is_file()


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


# The README's wheel install: build our wheels into one directory, then install from it alone
# (--no-index: same-named distributions on the public index belong to other projects).
WHEELS = {
    "tokenspeed-kernel": "tokenspeed_kernel",
    "tokenspeed-kernel-triton": "tokenspeed_kernel_triton",
    "tokenspeed-kernel-nvidia": "tokenspeed_kernel_nvidia",
    "tokenspeed-kernel-amd": "tokenspeed_kernel_amd",
}


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory):
    """Our four wheels built as the README builds them, and an empty virtual environment that
    sees only the *metadata* of the installed torch and triton and of what they require (their
    .dist-info directories, linked): pip resolves against that torch and never looks for one
    online, and our editable installs in this environment stay out of the way."""
    pip_version = tuple(int(p) for p in importlib.metadata.version("pip").split(".")[:2])
    if pip_version < (22, 3):
        pytest.skip(f"pip {'.'.join(map(str, pip_version))} has no --python (22.3+)")
    pytest.importorskip("hatchling", reason="the wheels build without isolation: pip install hatchling")
    root = tmp_path_factory.mktemp("wheels")
    dist = root / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist)]
        + [str(REPO / "packages" / name) for name in WHEELS],
        check=True,
    )
    view = root / "installed-metadata"
    view.mkdir()
    for path in _installed_closure(["torch", "triton"]):
        (view / path.name).symlink_to(path)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (pathlib.Path(purelib) / "installed_metadata.pth").write_text(f"{view}\n")
    return dist, python


def _installed_closure(names: list[str]) -> list[pathlib.Path]:
    """The .dist-info directories of ``names`` and of everything they require, as installed."""
    from packaging.requirements import Requirement

    found: dict[str, pathlib.Path] = {}
    todo = list(names)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in found:
            continue
        dist = importlib.metadata.distribution(name)
        path = getattr(dist, "_path", None)  # PathDistribution: its .dist-info directory
        assert path is not None, f"cannot locate the metadata of the installed {name}"
        found[name] = pathlib.Path(path)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(found.values())


def _resolve(wheel_env, requirement: str) -> dict[str, str]:
    """``pip install --dry-run --no-index --find-links DIST --report`` of ``requirement``:
    ``{name: the file it would install}``."""
    dist, python = wheel_env
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--dry-run", "--no-index"]
    run = subprocess.run(
        [*pip, "--find-links", str(dist), "--report", "-", requirement],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    return {item["metadata"]["name"]: item["download_info"]["url"].rsplit("/", 1)[-1] for item in report["install"]}


RESOLVES = {
    "tokenspeed-kernel[nvidia]": ["tokenspeed-kernel", "tokenspeed-kernel-triton", "tokenspeed-kernel-nvidia"],
    "tokenspeed-kernel[all]": list(WHEELS),
    "tokenspeed-kernel-amd": ["tokenspeed-kernel", "tokenspeed-kernel-triton", "tokenspeed-kernel-amd"],
    "tokenspeed-kernel-triton": ["tokenspeed-kernel", "tokenspeed-kernel-triton"],
}


def test_readme_wheel_install_is_the_one_tested():
    """The README's wheel block builds every wheel this test builds, the way it builds them,
    and installs only requirements that the resolution test below covers."""
    (block,) = [b for b in _bash_blocks((REPO / "README.md").read_text()) if any("pip wheel" in c for c in b)]
    (build,) = [c for c in block if c.startswith("pip wheel ")]
    assert build.startswith("pip wheel --no-deps --no-build-isolation -w dist ")
    assert build.split()[6:] == [f"packages/{name}" for name in WHEELS]
    installs = [c for c in block if c.startswith("pip install --no-index --find-links dist ")]
    assert installs, block
    for command in installs:
        requirement = command.split()[-1].strip('"')
        assert requirement in RESOLVES, f"{requirement!r} (README) is not resolved by the test"


@pytest.mark.slow
@pytest.mark.parametrize(("requirement", "expected"), list(RESOLVES.items()))
def test_wheels_install_from_a_local_directory_against_the_installed_torch(wheel_env, requirement, expected):
    """An extra of the core, or a vendor wheel alone, pulls exactly our wheels it needs from
    the directory, each at our version; torch and triton are the installed ones (not listed)."""
    version = tokenspeed_kernel.__version__
    files = _resolve(wheel_env, requirement)
    assert sorted(files) == sorted(expected), files
    for name, file in files.items():
        assert file == f"{WHEELS[name]}-{version}-py3-none-any.whl", (name, file)


@pytest.mark.slow
def test_each_wheel_holds_its_package_and_registers_its_backend(wheel_env):
    import zipfile

    dist, _ = wheel_env
    version = tokenspeed_kernel.__version__
    for name, module in WHEELS.items():
        with zipfile.ZipFile(dist / f"{module}-{version}-py3-none-any.whl") as wheel:
            names = wheel.namelist()
            assert f"{module}/__init__.py" in names, name
            entry_points = f"{module}-{version}.dist-info/entry_points.txt"
            if name == "tokenspeed-kernel":
                assert "tokenspeed-kernel = tokenspeed_kernel.cli:main" in wheel.read(entry_points).decode()
                _assert_build_record(wheel.read("tokenspeed_kernel/_build_info.py").decode())
            else:
                text = wheel.read(entry_points).decode()
                assert "[tokenspeed_kernel.backends]" in text and f"= {module}:register" in text, text


def _assert_build_record(text: str) -> None:
    """The core wheel's ``_build_info.py`` (packages/tokenspeed-kernel/hatch_build.py) names
    the commit checked out here, or None when this tree is not a git checkout."""
    record: dict = {}
    exec(compile(text, "_build_info.py", "exec"), record)
    import shutil

    head = shutil.which("git") and subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True
    )
    expected = head.stdout.strip() if head and head.returncode == 0 else None
    assert record["COMMIT"] == expected and isinstance(record["DIRTY"], bool) == (expected is not None), text


@pytest.mark.parametrize("parts", [("1", "2"), ("both",)], ids=["two-calls", "both"])
def test_the_gpu_suite_runs_every_test_module_once(parts):
    """ci/device/gpu_suite.sh's shards, as laid out for two calls (PART=1, PART=2) or one
    two-GPU call (PART=both), cover every test module of the repository exactly once, but
    the ahead-of-time compile tests, which it lists as CPU-only (CI runs them) and never runs
    (DRY_RUN: the lanes are listed, nothing installed or run)."""
    listed: list[str] = []
    ci_only: set[str] = set()
    for part in parts:
        shown = subprocess.run(
            ["bash", "ci/device/gpu_suite.sh"],
            cwd=REPO,
            env={"PATH": "/usr/bin:/bin", "PART": part, "DRY_RUN": "1"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        listed += [line.strip() for line in shown.splitlines() if line.startswith("    tests/")]
        ci_only |= {line.split("ci-only: ")[1] for line in shown.splitlines() if "ci-only: " in line}
    modules = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py"))
    assert ci_only and all("/test_aot" in m for m in ci_only) and not ci_only & set(listed)
    assert sorted(listed + sorted(ci_only)) == modules
