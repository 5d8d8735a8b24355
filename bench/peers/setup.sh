#!/usr/bin/env bash
# The peers' virtual environments for bench/peers.py: one venv a peer library, each
# with its own Python, built the same way every time.
#
#   bash bench/peers/setup.sh [--only NAME[,NAME]] [--relock] [DIR]
#
# DIR (default $HOME/moolib-peer-venvs) gets one venv a peer, recreated from empty:
#
#   sf         Sample Factory 2.1.1
#   rllib      ray[rllib] 2.60.0
#   torchrl    torchrl 0.14.1
#   sb3        stable-baselines3 2.9.2
#   cleanrl    cleanrl 0.4.8 (the latest on PyPI)
#   pufferlib  pufferlib 3.0.0
#
# Each gets torch 2.13.0 first, then the project's ALE and MinAtar (ale-py 0.12.1,
# minatar 1.0.15), opencv-python-headless (gymnasium's Atari preprocessing needs
# cv2) and gymnasium 1.4.0, unless the library pins another.
#
# By default a venv installs exactly bench/peers/locks/NAME.txt (pip install --no-deps
# -r, after torch), then its pip freeze must equal that lock, so a rebuild has the
# same versions. --relock resolves from the top-level pins below instead and rewrites
# the lock: the venv's `pip freeze --all`, less torch. torch is left out because its
# build depends on the machine's wheels (here the CPU wheel that PIP_FIND_LINKS
# points to, 2.13.0+cpu, which is on no registry); everything else in a lock is on
# PyPI. The locks are for CPython 3.11 on x86-64 Linux (PYTHON picks the
# interpreter, default python3).
#
# The last lines printed are the --...-python flags to give bench/peers.py.
set -Eeuo pipefail
exec </dev/null

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
LOCKS=$HERE/locks
PYTHON=${PYTHON:-python3}
PEERS=(sf rllib torchrl sb3 cleanrl pufferlib)

TORCH=torch==2.13.0
BASE=(ale-py==0.12.1 minatar==1.0.15 opencv-python-headless)
PUFFERLIB=pufferlib==3.0.0

usage() {
    sed -n '2,29p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

relock=0
only=""
dir=""
while (($#)); do
    case $1 in
        --relock) relock=1 ;;
        --only) only=${2:?--only needs NAME[,NAME]}; shift ;;
        --only=*) only=${1#--only=} ;;
        -h | --help) usage ;;
        -*) echo "setup.sh: unknown option $1" >&2; usage ;;
        *) [[ -z $dir ]] || usage; dir=$1 ;;
    esac
    shift
done
dir=${dir:-$HOME/moolib-peer-venvs}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

selected=("${PEERS[@]}")
if [[ -n $only ]]; then
    IFS=, read -r -a selected <<<"$only"
    for name in "${selected[@]}"; do
        [[ " ${PEERS[*]} " == *" $name "* ]] || {
            echo "setup.sh: unknown peer '$name' (one of: ${PEERS[*]})" >&2
            exit 2
        }
    done
fi

current=""
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
trap 'echo "setup.sh: FAILED building the $current venv ($dir/$current): see the output above" >&2' ERR

pip() { "$dir/$current/bin/python" -m pip "$@"; }

# The top-level pins, one function a peer: what --relock resolves from.

resolve_sb3() {
    pip install "$TORCH" "${BASE[@]}" gymnasium==1.4.0 stable-baselines3==2.9.2
}

resolve_torchrl() {
    pip install "$TORCH" "${BASE[@]}" gymnasium==1.4.0 torchrl==0.14.1
}

# ray[rllib] 2.60.0 pins gymnasium==1.2.2; ale-py 0.12.1 loads under it.
resolve_rllib() {
    pip install "$TORCH" "${BASE[@]}" gymnasium==1.2.2 "ray[rllib]==2.60.0"
}

# sample-factory 2.1.1 declares gymnasium<1.0, which cannot load ale-py 0.12.1, so it
# goes in with --no-deps beside gymnasium 1.4.0 and the rest of its declared
# dependencies (opencv-python-headless for its opencv-python: both are cv2, and one
# venv holds one). numpy stays below 2, as it declares: with numpy 2 its rollout
# workers fail on the first step (a 1-element array assigned to a scalar slot).
resolve_sf() {
    pip install "$TORCH" "${BASE[@]}" gymnasium==1.4.0 "numpy<2" colorlog filelock \
        "huggingface-hub>=0.10.0,<1.0" "psutil>=5.7.0" pyglet "signal-slot-mp>=1.0.3,<2.0" \
        "tensorboard>=1.15.0" "tensorboardx>=2.0" "threadpoolctl>=2.0.0" "wandb>=0.12.9"
    pip install --no-deps sample-factory==2.1.1
}

# cleanrl 0.4.8 (2021) declares gym, torch, tensorboard, wandb, stable_baselines3 and
# seaborn, none pinned: they resolve beside gymnasium 1.4.0.
resolve_cleanrl() {
    pip install "$TORCH" "${BASE[@]}" gymnasium==1.4.0 cleanrl==0.4.8
}

# pufferlib 3.0.0 declares gymnasium<=0.29.1, which cannot load ale-py 0.12.1: like
# Sample Factory it goes in with --no-deps beside gymnasium 1.4.0, numpy below 2 and
# the rest of its declared dependencies (gym<=0.23 is imported by pufferlib.spaces).
# It is a source distribution whose setup.py imports torch, numpy and Cython: they
# are installed first and it builds without isolation (build_pufferlib).
resolve_pufferlib() {
    pip install "$TORCH" "${BASE[@]}" gymnasium==1.4.0 "numpy<2" "gym<=0.23" \
        "pettingzoo<=1.24.1" "shimmy[gym-v21]" setuptools wheel Cython psutil pynvml rich \
        rich_argparse imageio pyro-ppl heavyball neptune wandb
    build_pufferlib "$PUFFERLIB"
}

# PufferLib's setup.py downloads raylib and box2d at build time (box2d as whatever
# release is newest) to build its Ocean C environments, which the benchmark does
# not use: NO_OCEAN=1 skips them. With NO_OCEAN=1, 3.0.0's setup.py still names
# c_extension_paths, which it only assigns when building Ocean; the sitecustomize
# below makes that name an empty list, as a build without Ocean would have it.
# setup.py compiles pufferlib._C (the advantage kernel its trainer imports) as a
# CUDA extension whenever nvcc is on PATH, which fails against a CPU torch: the
# build runs with the folders holding nvcc taken off PATH when torch has no CUDA.
# No wheel cache: the extension must be built against this venv's torch.
build_pufferlib() {
    local shim=$tmp/pufferlib-shim path=$PATH
    mkdir -p "$shim"
    printf 'import builtins\n\nbuiltins.c_extension_paths = []\n' >"$shim/sitecustomize.py"
    if ! "$dir/$current/bin/python" -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then
        path=$(tr : '\n' <<<"$PATH" | while read -r d; do [[ -x $d/nvcc ]] || echo "$d"; done | paste -sd:)
    fi
    PATH=$path NO_OCEAN=1 PYTHONPATH=$shim pip install --no-cache-dir --no-deps --no-build-isolation "$1"
}

freeze() {
    pip freeze --all | grep -v -i '^torch=='
}

lock_header() {
    echo "# bench/peers/setup.sh --relock: pip freeze --all of the $1 venv, less torch"
    echo "# ($TORCH, installed first by setup.sh). $("$dir/$current/bin/python" -c \
        'import platform; print(platform.python_implementation(), platform.python_version(), platform.machine())')."
}

build() {
    current=$1
    local venv=$dir/$1 lock=$LOCKS/$1.txt
    if ((relock)); then
        echo "== $1: building $venv from the top-level pins (--relock), then writing $lock"
    else
        echo "== $1: building $venv from $lock"
        [[ -f $lock ]] || { echo "setup.sh: no lock $lock (run with --relock)" >&2; false; }
    fi
    "$PYTHON" -m venv --clear "$venv"
    if ((relock)); then
        "resolve_$1"
        mkdir -p "$LOCKS"
        if freeze | grep ' @ '; then
            echo "setup.sh: the $1 venv holds packages from no registry (above)" >&2
            false
        fi
        { lock_header "$1"; freeze; } >"$lock"
    else
        pip install "$TORCH"
        # pufferlib builds against what the rest of the lock installs, so it goes last.
        grep -v -i '^pufferlib==' "$lock" >"$tmp/lock.txt"
        pip install --no-deps -r "$tmp/lock.txt"
        if grep -q -i '^pufferlib==' "$lock"; then
            build_pufferlib "$(grep -i '^pufferlib==' "$lock")"
        fi
        if ! diff <(grep -v '^#' "$lock") <(freeze) >"$tmp/diff.txt"; then
            echo "setup.sh: the $1 venv differs from $lock (< lock, > venv):" >&2
            cat "$tmp/diff.txt" >&2
            false
        fi
    fi
    echo "== $1: done ($venv/bin/python)"
}

for name in "${selected[@]}"; do
    build "$name"
done
current=""

# The flags bench/peers.py takes for the venvs now in DIR; a peer without a runner
# in bench/peers.py yet is listed apart.
declare -A FLAG=(
    [sf]=--sample-factory-python [rllib]=--rllib-python [torchrl]=--torchrl-python
    [sb3]=--sb3-python [cleanrl]=--cleanrl-python [pufferlib]=--pufferlib-python
)
flags=()
for name in "${PEERS[@]}"; do
    py=$dir/$name/bin/python
    [[ -x $py ]] || continue
    if grep -q -- "${FLAG[$name]}\"" "$REPO/bench/peers.py"; then
        flags+=("${FLAG[$name]} $py")
    else
        echo "(no runner in bench/peers.py yet: $name $py)"
    fi
done
echo "bench/peers.py flags:"
echo "${flags[*]}"
