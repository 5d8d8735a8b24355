"""Build moolib: the Python package and its C++17 core, moolib._core (no libtorch)."""

import glob
import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# The core is a dozen translation units, compiled in parallel (the README's
# Install says how long an install takes on 2 cores).
ParallelCompile("MOOLIB_BUILD_JOBS", default=0).install()

sources = sorted(glob.glob("moolib/core/**/*.cc", recursive=True))

extra_compile_args = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fvisibility=hidden"]
extra_link_args = []
# UCX is optional at build time and at run time (libucp is loaded with dlopen).
# MOOLIB_UCX=0 builds as if UCX's headers were absent, as on a machine without
# libucx-dev; tests/test_build_without_ucx.py builds that way.
if os.environ.get("MOOLIB_UCX", "1").strip().lower() in ("0", "off", "false", "no"):
    extra_compile_args += ["-DMOOLIB_WITHOUT_UCX"]
if os.environ.get("MOOLIB_DEBUG"):
    extra_compile_args += ["-O0", "-g", "-fno-omit-frame-pointer"]
sanitizer = os.environ.get("MOOLIB_SANITIZE")  # e.g. "address" or "thread"
if sanitizer:
    extra_compile_args += [f"-fsanitize={sanitizer}", "-g", "-fno-omit-frame-pointer"]
    extra_link_args += [f"-fsanitize={sanitizer}"]

core = Pybind11Extension(
    "moolib._core",
    sources,
    include_dirs=["moolib/core"],
    cxx_std=17,
    extra_compile_args=extra_compile_args,
    libraries=["crypto", "pthread"],
    extra_link_args=extra_link_args,
)

setup(
    name="moolib",
    version="0.1.0",
    description="Communications library for distributed RL/ML training, and an RL toolkit",
    python_requires=">=3.10",
    # The toolkit's top-level folders install inside the moolib namespace, so
    # their generic names (envs, agents, ...) cannot collide with other packages.
    packages=[
        "moolib",
        "moolib.agents",
        "moolib.agents.math",
        "moolib.agents.nets",
        "moolib.agents.runtime",
        "moolib.conf",
        "moolib.conf.schema",
        "moolib.envs",
        "moolib.launch",
        "moolib.launch.scaling",
        "moolib.replay",
    ],
    package_dir={
        "moolib.agents": "agents",
        "moolib.conf": "conf",
        "moolib.envs": "envs",
        "moolib.launch": "launch",
    },
    # The Hydra config ships inside the package, so moolib-run works from anywhere.
    package_data={"moolib": ["_core.pyi", "py.typed"], "moolib.conf": ["*.yaml", "*/*.yaml"]},
    ext_modules=[core],
    cmdclass={"build_ext": build_ext},
    install_requires=[
        "numpy",
        "cloudpickle",
        "gymnasium>=1.0",
        "ale-py>=0.9",
        # gymnasium's AtariPreprocessing resizes frames with OpenCV.
        "opencv-python-headless",
        "hydra-core>=1.3",
        "rich",
        "matplotlib",
        "plotext>=6",
        # scaling=slurm submits its jobs through submitit.
        "submitit>=1.5",
    ],
    # What only some runs need; each is imported through moolib._extras, which names
    # the extra when it is missing (moolib-run refuses such a run before it starts).
    extras_require={
        # MinAtar's games (env=minatar-breakout, ...); 1.0.15 works with numpy 2. It
        # requires pandas, scipy and seaborn, which nothing else here needs.
        "minatar": ["minatar>=1.0.15"],
        # wandb.enabled=true.
        "wandb": ["wandb"],
        # tensorboard.enabled=true: torch writes the event files with it.
        "tensorboard": ["tensorboard"],
        # The envpool library's C++ Atari: a second environment backend.
        "envpool": ["envpool"],
        # moolib-eval video=true: MP4s written by ffmpeg (imageio-ffmpeg ships it;
        # gymnasium's RecordVideo would bring moviepy, which needs imageio-ffmpeg and
        # more), and pygame, which draws CartPole's frames (gymnasium's classic-control).
        "video": ["imageio-ffmpeg", "pygame"],
        # gymnasium's MuJoCo tasks (env=mujoco-half_cheetah, ...): continuous actions.
        # gymnasium's MuJoCo module imports imageio (for its renderer) when loaded.
        "mujoco": ["mujoco>=3,<4", "imageio"],
        # The build requirements too: tests/test_packaging.py builds a wheel
        # without build isolation (no network).
        "test": [
            "pytest>=7",
            "pytest-timeout",
            "pytest-xdist",
            "ruff",
            "minatar>=1.0.15",
            "wandb",
            "tensorboard",
            "envpool",
            "imageio-ffmpeg",
            "pygame",
            "mujoco>=3,<4",
            "imageio",
            "setuptools>=64",
            "wheel",
            "pybind11>=2.12",
        ],
    },
    entry_points={
        "console_scripts": [
            "moolib-broker=moolib.broker:main",
            "moolib-run=moolib.launch.run:main",
            "moolib-plot=moolib.launch.plot:main",
            "moolib-eval=moolib.launch.evaluate:main",
            "moolib-jobs=moolib.launch.jobs:main",
        ]
    },
    zip_safe=False,
)
