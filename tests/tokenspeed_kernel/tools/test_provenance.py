"""The commit the tools' JSON reports is the code that ran: the environment's word, the
package's own git checkout (editable install), or the wheel's build-time record; never the
current directory (on a GPU machine, a copy of some working tree)."""

import shutil
import subprocess
import sys
import types

import pytest

from tokenspeed_kernel.tools import common
from tokenspeed_kernel.tools.common import COMMIT_ENV, PROVENANCE_KEYS, provenance, source_commit

SHA = "0123456789abcdef0123456789abcdef01234567"
NO_MODULE = "tokenspeed_kernel_tests_no_such_build_info"

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(where, *args):
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(cmd, cwd=where, capture_output=True, text=True, check=True).stdout.strip()


def _checkout(root, tracked=True):
    """A git checkout at ``root`` with a package directory ``pkg`` whose ``__init__.py`` is
    committed (``tracked``) or left untracked; returns (package dir, HEAD)."""
    pkg = root / "pkg"
    pkg.mkdir(parents=True)
    (root / "README").write_text("x\n")
    (pkg / "__init__.py").write_text("")
    _git(root, "init", "-q")
    _git(root, "add", "README", *(["pkg/__init__.py"] if tracked else []))
    _git(root, "commit", "-q", "-m", "one")
    return pkg, _git(root, "rev-parse", "HEAD")


@pytest.fixture
def wheel_module(monkeypatch):
    """A stand-in for the module a wheel build generates (hatch_build.py)."""
    module = types.ModuleType("fake_build_info")
    module.COMMIT, module.DIRTY = SHA, False
    monkeypatch.setitem(sys.modules, "fake_build_info", module)
    monkeypatch.delenv(COMMIT_ENV, raising=False)
    return module


def test_the_environment_names_the_commit_over_everything(monkeypatch, tmp_path, wheel_module):
    monkeypatch.setenv(COMMIT_ENV, "abc1234-dirty")
    assert source_commit(tmp_path, "fake_build_info") == {"commit": "abc1234", "dirty": True, "from": "env"}
    monkeypatch.setenv(COMMIT_ENV, SHA)
    assert source_commit(tmp_path, "fake_build_info") == {"commit": SHA, "dirty": False, "from": "env"}


def test_an_installed_wheel_reports_its_build_record(tmp_path, wheel_module):
    assert source_commit(tmp_path, "fake_build_info") == {"commit": SHA, "dirty": False, "from": "wheel"}
    wheel_module.DIRTY = True
    assert source_commit(tmp_path, "fake_build_info")["dirty"] is True


@pytest.mark.parametrize("commit", [None, "unknown", "", 42])
def test_a_wheel_built_outside_git_reports_no_commit(tmp_path, wheel_module, commit):
    wheel_module.COMMIT = commit
    assert source_commit(tmp_path, "fake_build_info") == {"commit": None, "dirty": None, "from": None}


def test_no_record_and_no_checkout_reports_no_commit(tmp_path, monkeypatch):
    monkeypatch.delenv(COMMIT_ENV, raising=False)
    assert source_commit(tmp_path, NO_MODULE) == {"commit": None, "dirty": None, "from": None}


@needs_git
def test_the_current_directory_is_never_read(tmp_path, monkeypatch):
    """The stale-commit bug: a GPU machine runs the installed wheels from a copy of some tree."""
    monkeypatch.delenv(COMMIT_ENV, raising=False)
    _checkout(tmp_path / "copy")
    monkeypatch.chdir(tmp_path / "copy")
    (tmp_path / "site").mkdir()
    assert source_commit(tmp_path / "site", NO_MODULE)["commit"] is None


@needs_git
def test_a_wheel_installed_inside_a_checkout_reports_its_build_record(tmp_path, wheel_module):
    """A virtual environment in a repository: the package directory is there but not tracked."""
    pkg, head = _checkout(tmp_path, tracked=False)
    assert head != SHA and source_commit(pkg, "fake_build_info") == {"commit": SHA, "dirty": False, "from": "wheel"}


@needs_git
def test_an_editable_install_reads_its_own_checkout(tmp_path, wheel_module):
    pkg, head = _checkout(tmp_path)
    assert source_commit(pkg, "fake_build_info") == {"commit": head, "dirty": False, "from": "git"}
    (pkg / "__init__.py").write_text("changed = True\n")
    assert source_commit(pkg, "fake_build_info") == {"commit": head, "dirty": True, "from": "git"}


def test_provenance_is_one_block_with_the_versions(monkeypatch):
    monkeypatch.setattr(common, "source_commit", lambda: {"commit": SHA, "dirty": True, "from": "env"})
    block = provenance()
    assert tuple(block) == PROVENANCE_KEYS
    assert (block["commit"], block["dirty"], block["commit_from"]) == (SHA, True, "env")
    assert "torch" in block["versions"] and "tokenspeed-kernel" in block["versions"] and block["python"]
