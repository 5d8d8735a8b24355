"""The source distribution builds a working moolib: an sdist made from this
checkout holds every file the build and the package need (the core's headers
are not named by setup.py, only its .cc sources), and the wheel built from that
sdist alone, outside this checkout, imports and serves a real call."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from helpers.util import DEADLINE, REPO

# What a checkout holds besides the sources: build outputs and tool caches.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".*_cache", "wandb"
)
PACKAGE_DIRS = ["moolib", "agents", "conf", "envs", "launch"]


def package_files() -> set[str]:
    """The package's files in the checkout, relative to it."""
    found = set()
    for top in PACKAGE_DIRS:
        for path in (REPO / top).rglob("*"):
            if path.is_file() and path.suffix in {".py", ".cc", ".h", ".yaml", ".pyi", ".typed"}:
                if "__pycache__" not in path.parts:
                    found.add(str(path.relative_to(REPO)))
    return found


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    """An sdist built from a copy of the checkout (the build writes egg-info)."""
    root = tmp_path_factory.mktemp("packaging")
    src = root / "src"
    shutil.copytree(REPO, src, ignore=NOT_SOURCE)
    out = subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "-d", str(root / "dist")],
        cwd=src,
        capture_output=True,
        text=True,
        timeout=3 * DEADLINE,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (archive,) = (root / "dist").glob("moolib-*.tar.gz")
    return archive


def test_the_sdist_holds_every_source_and_config_file(sdist):
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = sorted(package_files() - names)
    assert not missing, f"not in the sdist: {missing}"
    assert any(n.startswith("moolib/core/transport/") and n.endswith(".h") for n in names)


def test_a_wheel_built_from_the_sdist_alone_works(sdist, tmp_path):
    # The build compiles with the compiler the environment names: .ci/run puts
    # ccache in front (CC, CXX), which serves the install's objects again where the
    # sdist's sources and headers are the same files; a missing one still fails.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MOOLIB_AUTH_KEY")}
    built = subprocess.run(
        # No build isolation: the build requirements are installed with the
        # test extras, and the test must not need the network.
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp_path / "wheel"), str(sdist)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=10 * DEADLINE,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "wheel").glob("moolib-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as whl:
        whl.extractall(site)
        names = set(whl.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = whl.read(entry_points).decode()
    for script in ("moolib-run", "moolib-broker", "moolib-plot", "moolib-jobs"):
        assert f"{script} = " in scripts
    configs = {p.relative_to(REPO / "conf") for p in (REPO / "conf").rglob("*.yaml")}
    assert {Path("moolib/conf") / c for c in configs} <= {Path(n) for n in names}

    # Outside the checkout, with only the wheel's files on the path: the core
    # it compiled serves a call, and the toolkit finds its configs.
    code = (
        "import moolib, moolib.launch.run\n"
        f"assert moolib.__file__.startswith({str(site)!r}), moolib.__file__\n"
        "s = moolib.Rpc(); s.set_name('s'); s.define('add', lambda a, b: a + b)\n"
        "c = moolib.Rpc(); c.connect(s.listen('127.0.0.1:0'))\n"
        "print(c.sync('s', 'add', 1, 2))\n"
        "from importlib.resources import files\n"
        "print(files('moolib.conf').joinpath('env', 'minatar.yaml').is_file())\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=3 * DEADLINE,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.split() == ["3", "True"]
