#!/usr/bin/env bash
# The runs behind the result figures of docs/results.md, by name, with their exact
# moolib-run command lines. Each writes into results/<NAME> (in the repository);
# running the same NAME again resumes that savedir from its last checkpoint (a
# finished run says so and exits 0).
#
#   scripts/reproduce.sh --list               # every NAME, one a line
#   scripts/reproduce.sh --print NAME         # its command line, without running it
#   scripts/reproduce.sh NAME [OVERRIDE ...]  # runs it (overrides are appended: device=cuda, ...)
#   moolib-plot results/NAME                  # its curve
#
# MOOLIB_RESULTS (default results, in the repository) is where the savedirs go.
#
# Names:
#   minatar-<game>-seed<0|1>  V-trace on a MinAtar game (asterix, breakout, freeway, seaquest,
#                             space_invaders) for the paper's 5M frames (one frame is one env
#                             step), with conf/tuning/vtrace_minatar.yaml (9k-19k steps/s on a
#                             2-core CPU, by game: 5 to 10 minutes a run)
#   pong-cpu, breakout-cpu    V-trace from pixels on a CPU with the shallow IMPALA network (the
#                             RMSProp of TorchBeast: lr 4.8e-4, eps 0.01; the rest as
#                             conf/agent/vtrace.yaml: actor batches 2 x 32 on 2 processes,
#                             learner batch 8 x 20 steps), 5M steps (20M frames):
#                             ~580 steps/s on a 2-core CPU, about 2.5 hours a run; see
#                             docs/results.md
#   pong-cpu-nosticky,        the same without sticky actions, as the published IMPALA,
#   breakout-cpu-nosticky     TorchBeast and original moolib curves were made, and on the
#                             original moolib's 50M-step learning-rate schedule (its
#                             examples/vtrace/config.yaml): stop it with Ctrl-C at any
#                             point and run it again to go on
#   breakout-cpu-nosticky-entropy
#                             breakout-cpu-nosticky with 5x its entropy cost (0.003): that
#                             run's policy turned deterministic at 3M steps and stayed at 7.3
#   ppo-pendulum-seed1        PPO on Pendulum-v1 (continuous actions) with
#                             conf/tuning/ppo_pendulum.yaml: 100k steps, a few minutes
#   ppo-half_cheetah-seed1    PPO on MuJoCo's HalfCheetah-v5 (the mujoco extra) with
#                             conf/tuning/ppo_mujoco.yaml, CleanRL's settings: 1M steps
set -euo pipefail
cd "$(dirname "$0")/.."

RESULTS=${MOOLIB_RESULTS:-results}
MINATAR_GAMES=(asterix breakout freeway seaquest space_invaders)
SEEDS=(0 1)

names() {
  local game seed
  for game in "${MINATAR_GAMES[@]}"; do
    for seed in "${SEEDS[@]}"; do
      echo "minatar-$game-seed$seed"
    done
  done
  echo pong-cpu
  echo breakout-cpu
  echo pong-cpu-nosticky
  echo breakout-cpu-nosticky
  echo breakout-cpu-nosticky-entropy
  echo ppo-pendulum-seed1
  echo ppo-half_cheetah-seed1
}

# V-trace on the Atari game $1 from pixels on a CPU; the rest of the arguments go between
# the seed and the device.
atari() {
  local game=$1
  shift
  printf '%s\n' agent=vtrace "env=$game" agent.network=impala_shallow \
    agent.optimizer.name=rmsprop agent.optimizer.learning_rate=0.00048 \
    agent.optimizer.epsilon=0.01 seed=0 "$@" device=cpu
}

# The moolib-run arguments of NAME (without the savedir), one a line.
arguments() {
  local name=$1 game seed
  case "$name" in
    minatar-*-seed*)
      game=${name#minatar-}
      game=${game%-seed*}
      seed=${name##*-seed}
      printf '%s\n' agent=vtrace "env=minatar-$game" "seed=$seed" total_steps=5000000 device=cpu
      ;;
    pong-cpu | breakout-cpu)
      atari "${name%-cpu}" total_steps=5000000
      ;;
    pong-cpu-nosticky | breakout-cpu-nosticky)
      atari "${name%-cpu-nosticky}" env.options.repeat_action_probability=0 total_steps=50000000
      ;;
    breakout-cpu-nosticky-entropy)
      atari breakout env.options.repeat_action_probability=0 agent.entropy_cost=0.003 \
        total_steps=50000000
      ;;
    ppo-pendulum-seed*)
      printf '%s\n' agent=ppo env=pendulum "seed=${name##*-seed}" device=cpu
      ;;
    ppo-half_cheetah-seed*)
      printf '%s\n' agent=ppo env=mujoco-half_cheetah "seed=${name##*-seed}" device=cpu
      ;;
    *) return 1 ;;
  esac
}

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

known() {
  # No pipe into grep -q: it exits at the first match, and under pipefail the
  # SIGPIPE that names then takes would make a known name look unknown.
  local name
  for name in $(names); do
    [[ $name == "$1" ]] && return 0
  done
  return 1
}

case "${1:-}" in
  --list)
    names
    ;;
  --print)
    name=${2:?usage: scripts/reproduce.sh --print NAME}
    known "$name" || { echo "reproduce.sh: no result named '$name' (see --list)" >&2; exit 2; }
    echo "moolib-run $(arguments "$name" | tr '\n' ' ')savedir=$RESULTS/$name"
    ;;
  "" | -h | --help)
    usage
    ;;
  *)
    name=$1
    shift
    known "$name" || { echo "reproduce.sh: no result named '$name' (see --list)" >&2; exit 2; }
    mapfile -t args < <(arguments "$name")
    mkdir -p "$RESULTS"
    set -x
    exec moolib-run "${args[@]}" "savedir=$RESULTS/$name" "$@"
    ;;
esac
