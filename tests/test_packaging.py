"""The source distribution builds a working moolib: an sdist made from this
checkout holds every file the build and the package need (the core's headers
are not named by setup.py, only its .cc sources), and the wheel built from that
sdist alone, outside this checkout, imports and serves a real call."""

from __future__ import annotations

import json
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


def build_wheel(sdist: Path, root: Path, extra_env: dict[str, str] | None = None) -> Path:
    """Builds a wheel from the sdist alone in ``root`` and unpacks it; the folder
    to put on PYTHONPATH (a wheel is a zip of what site-packages gets)."""
    # The build compiles with the compiler the environment names: .ci/run puts
    # ccache in front (CC, CXX), which serves the install's objects again where the
    # sdist's sources and headers are the same files; a missing one still fails.
    env = {**clean_env(), **(extra_env or {})}
    built = subprocess.run(
        # No build isolation: the build requirements are installed with the
        # test extras, and the test must not need the network.
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(root / "wheel"), str(sdist)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=10 * DEADLINE,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (root / "wheel").glob("moolib-*.whl")
    site = root / "site"
    with zipfile.ZipFile(wheel) as whl:
        whl.extractall(site)
    return site


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MOOLIB_AUTH_KEY")}


@pytest.fixture(scope="module")
def site(sdist, tmp_path_factory) -> Path:
    """The unpacked wheel built from the sdist as a user builds it (with UCX's
    headers where the machine has them, as .ci/run's has)."""
    return build_wheel(sdist, tmp_path_factory.mktemp("wheel"))


def run_from(site: Path, code: str, cwd: Path, wrap: list[str] | None = None):
    """Runs ``code`` in a fresh Python that sees only ``site``'s moolib."""
    return subprocess.run(
        (wrap or []) + [sys.executable, "-c", code],
        cwd=cwd,
        env={**clean_env(), "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=3 * DEADLINE,
    )


@pytest.mark.slow
def test_a_wheel_built_from_the_sdist_alone_works(site, tmp_path):
    names = {str(p.relative_to(site)) for p in site.rglob("*") if p.is_file()}
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    scripts = (site / entry_points).read_text()
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
    ran = run_from(site, code, tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout.split() == ["3", "True"]


# Calls over shared memory and over TCP, each forced, checked by the transport
# debug_info() names for the link; then why UCX is off, as the last line.
CALLS_WITHOUT_UCX = """
import json, numpy as np, moolib
for transport in ("shm", "tcp"):
    server = moolib.Rpc(); server.set_name("server"); server.set_transports([transport])
    server.define("add", lambda a, b: a + b)
    client = moolib.Rpc(); client.set_transports([transport])
    client.connect(server.listen("127.0.0.1:0"))
    got = client.sync("server", "add", np.arange(1 << 16, dtype=np.int64), 1)
    assert (got == np.arange(1, (1 << 16) + 1)).all()
    (peer,) = [p for p in client.debug_info()["peers"] if p["name"] == "server"]
    print(transport, sorted(c["transport"] for c in peer["connections"]))
    client.close(); server.close()
status = moolib.Rpc().debug_info()["transport_status"]["ucx"]
print(json.dumps(status))
"""


def assert_calls_work_and_ucx_is_off(ran) -> str:
    """The calls went over the transport each asked for; UCX's reason to be off."""
    assert ran.returncode == 0, ran.stdout + ran.stderr
    *calls, status = ran.stdout.strip().splitlines()
    # A link over shared memory keeps the TCP connection it was set up over.
    assert calls in (["shm ['shm']", "tcp ['tcp']"], ["shm ['shm', 'tcp']", "tcp ['tcp']"]), calls
    status = json.loads(status)
    assert status["available"] is False, status
    return status["why"]


@pytest.mark.slow
def test_the_core_builds_and_works_without_ucx_headers(sdist, tmp_path):
    # MOOLIB_UCX=0 compiles as a machine without libucx-dev does (the README's
    # install names only libssl-dev and g++), whether or not this one has them.
    site = build_wheel(sdist, tmp_path, {"MOOLIB_UCX": "0"})
    why = assert_calls_work_and_ucx_is_off(run_from(site, CALLS_WITHOUT_UCX, tmp_path))
    assert "MOOLIB_UCX=0" in why, why


def test_a_core_built_with_ucx_works_where_ucx_libraries_are_absent(site, tmp_path):
    status = "import moolib; print(moolib.Rpc().debug_info()['transport_status'])"
    ucx = run_from(site, status, tmp_path)
    assert ucx.returncode == 0, ucx.stderr
    if "built without UCX's headers" in ucx.stdout:
        pytest.skip("this machine has no UCX headers (libucx-dev): the core was built without UCX")
    libraries = ucx_library_paths()
    if shutil.which("unshare") is None or os.geteuid() != 0 or not libraries:
        pytest.skip("hiding UCX's libraries needs root, unshare and UCX's libraries installed")
    # In a mount namespace of its own, the child finds every UCX library as an
    # empty file: as on a machine where they are not installed.
    empty = tmp_path / "empty.so"
    empty.touch()
    mounts = " && ".join(f"mount --bind {empty} {lib}" for lib in libraries)
    wrap = ["unshare", "--mount", "--propagation", "private"]
    wrap += ["sh", "-c", f'{mounts} && exec "$@"', "sh"]
    why = assert_calls_work_and_ucx_is_off(run_from(site, CALLS_WITHOUT_UCX, tmp_path, wrap))
    assert "cannot load libucp.so.0" in why, why


def ucx_library_paths() -> list[str]:
    """Where the dynamic loader finds UCX's libraries (ldconfig's cache)."""
    listed = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return sorted(
        {
            line.split("=>")[-1].strip()
            for line in listed.splitlines()
            if line.strip().split(" ")[0] in ("libucp.so.0", "libucs.so.0", "libuct.so.0")
        }
    )
