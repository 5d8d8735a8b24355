"""moolib.envs: real ALE games (Breakout, Pong) through the gymnasium backend
(create_env) and the envpool backend (create_envpool), and cartpole.

No timing assertions: episodes are bounded by generous step counts only.
"""

import functools
import os
import pickle
import subprocess
import sys

import cloudpickle
import moolib.envs as envs
import numpy as np
import pytest
import torch
from moolib.envs import atari, envpool_backend

GAMES = ["breakout", "pong"]
NUM_ACTIONS = {"breakout": 4, "pong": 6}
MAX_STEPS = 30_000  # far beyond a random-play episode of either game (~200 / ~900 steps)


def play_episode(env, rng, max_steps=MAX_STEPS):
    """Random actions until the episode ends; returns (steps, return, terminated)."""
    env.reset()
    total = 0.0
    for step in range(1, max_steps + 1):
        _, reward, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
        total += float(reward)
        if terminated or truncated:
            return step, total, terminated
    raise AssertionError(f"no episode end within {max_steps} steps")


def trajectory(env, actions):
    obs, _ = env.reset()
    out = [obs]
    for a in actions:
        out.append(env.step(int(a))[0])
    return np.stack(out)


def actions_of(batch_size, values):
    return torch.as_tensor(values, dtype=torch.int64).reshape(batch_size)


def zeros(batch_size):
    return torch.zeros(batch_size, dtype=torch.int64)


# -- names ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, ale_id",
    [
        ("breakout", "ALE/Breakout-v5"),
        ("pong", "ALE/Pong-v5"),
        ("space_invaders", "ALE/SpaceInvaders-v5"),
        ("ms_pacman", "ALE/MsPacman-v5"),
        ("beam_rider", "ALE/BeamRider-v5"),
        ("qbert", "ALE/Qbert-v5"),
        ("seaquest", "ALE/Seaquest-v5"),
        ("enduro", "ALE/Enduro-v5"),
        ("asterix", "ALE/Asterix-v5"),
        ("montezuma_revenge", "ALE/MontezumaRevenge-v5"),
        ("Space-Invaders", "ALE/SpaceInvaders-v5"),
        ("Breakout", "ALE/Breakout-v5"),
        ("ALE/Pong-v5", "ALE/Pong-v5"),
    ],
)
def test_short_names_map_to_ale_ids(name, ale_id):
    assert atari.atari_id(name) == ale_id


def test_short_name_and_ale_id_make_the_same_game():
    assert envs.create_env("space_invaders").spec.id == "ALE/SpaceInvaders-v5"
    assert envs.create_env("ALE/MontezumaRevenge-v5").spec.id == "ALE/MontezumaRevenge-v5"


def test_list_envs_and_atari_games():
    names = envs.list_envs()
    assert names[0] == "cartpole"
    for game in ("breakout", "pong", "space_invaders", "ms_pacman", "montezuma_revenge"):
        assert game in envs.ATARI_GAMES and game in names
    # Every listed game has an ALE id that resolves back to it.
    for game in envs.ATARI_GAMES:
        assert atari.atari_game(atari.atari_id(game)) == game


def test_cartpole_novel_hides_the_velocities():
    """cartpole-novel is CartPole-v1 seen through (x, theta): same dynamics, no velocities."""
    full, novel = envs.create_env("cartpole", seed=3), envs.create_env("cartpole-novel", seed=3)
    try:
        assert novel.observation_space.shape == (2,) and novel.action_space.n == 2
        obs_full, _ = full.reset(seed=3)
        obs_novel, _ = novel.reset(seed=3)
        for t in range(200):
            assert obs_novel.dtype == np.float32
            np.testing.assert_array_equal(obs_novel, obs_full[[0, 2]])
            action = t % 2
            obs_full, r1, term1, trunc1, _ = full.step(action)
            obs_novel, r2, term2, trunc2, _ = novel.step(action)
            assert (r1, term1, trunc1) == (r2, term2, trunc2)
            if term1 or trunc1:
                break
    finally:
        full.close()
        novel.close()


@pytest.mark.parametrize("name", ["breakot", "ALE/Breakot-v5", "brekout"])
def test_unknown_name_is_a_value_error_with_close_matches(name):
    with pytest.raises(ValueError, match="Unknown environment") as info:
        envs.create_env(name)
    assert "Did you mean: breakout" in str(info.value)
    with pytest.raises(ValueError, match="Did you mean: breakout"):
        envs.create_envpool(name, 1, 1)


def test_unknown_name_without_close_match():
    with pytest.raises(ValueError, match="Unknown environment 'zzzz'.*list_envs"):
        envs.create_env("zzzz")


def test_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="frame_skipp"):
        envs.create_env("breakout", frame_skipp=2)
    with pytest.raises(TypeError):
        envs.create_env("cartpole", noop_max=3)


@pytest.mark.parametrize(
    "options",
    [
        {"noop_max": -1},
        {"repeat_action_probability": 1.5},
        {"max_episode_frames": 0},
        {"full_action_space": "no"},
        {"episodic_life": 1},
    ],
)
def test_bad_option_values(options):
    # Named in the message, and a flag is never coerced (bool("no") is True).
    (name,) = options
    with pytest.raises(ValueError, match=name):
        envs.create_env("breakout", **options)
    with pytest.raises(ValueError, match=name):
        envs.create_envpool("breakout", 1, 1, **options)


def test_factories_pickle():
    for factory in (
        functools.partial(envs.create_env, "breakout"),
        functools.partial(envs.create_env, "cartpole", seed=3),
    ):
        for dumps in (pickle.dumps, cloudpickle.dumps):
            env = pickle.loads(dumps(factory))()
            obs, _ = env.reset()
            assert obs.shape == env.observation_space.shape


def test_factory_in_moolib_envpool():
    """moolib.EnvPool's workers get the factory through cloudpickle."""
    import moolib

    factory = functools.partial(envs.create_env, "breakout")
    with moolib.EnvPool(factory, 2, 2, 1) as pool:
        out = pool.step(0, zeros(2)).result()
        assert out["state"].shape == (2, 4, 84, 84) and out["state"].dtype == torch.uint8
        for _ in range(10):
            out = pool.step(0, torch.randint(0, 4, (2,))).result()
            assert out["state"].shape == (2, 4, 84, 84)


def test_create_env_keeps_the_ale_banner_to_itself():
    """No "A.L.E: Arcade Learning Environment" banner from a library user's envs,
    in this process or in an EnvPool's workers (a fresh process: ALE prints it
    once per process)."""
    code = (
        "import functools, torch, moolib; from moolib.envs import create_env; "
        "create_env('breakout').reset(); "
        "pool = moolib.EnvPool(functools.partial(create_env, 'breakout'), 2, 2, 1); "
        "pool.step(0, torch.zeros(2, dtype=torch.int64)).result(); pool.close(); print('DONE')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert "DONE" in out.stdout
    assert "A.L.E" not in out.stdout + out.stderr, out.stdout + out.stderr


def test_import_does_not_import_envpool_or_torch():
    code = (
        "import sys, moolib.envs; "
        "assert 'envpool' not in sys.modules, 'envpool'; "
        "assert 'torch' not in sys.modules, 'torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_missing_envpool_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "envpool", None)  # makes `import envpool` fail
    with pytest.raises(ImportError, match=r"moolib\[envpool\]"):
        envpool_backend.import_envpool()


# -- cartpole -----------------------------------------------------------------


def test_cartpole():
    env = envs.create_env("cartpole", seed=0)
    obs, _ = env.reset()
    assert obs.shape == (4,) and obs.dtype == np.float32
    assert env.action_space.n == 2
    steps, total, _ = play_episode(env, np.random.default_rng(0), max_steps=1000)
    assert total == steps


# -- gymnasium backend --------------------------------------------------------


@pytest.mark.parametrize("game", GAMES)
def test_gym_observations_and_episode_end(game):
    env = envs.create_env(game)
    assert env.observation_space.shape == (4, 84, 84)
    assert env.observation_space.dtype == np.uint8
    assert env.action_space.n == NUM_ACTIONS[game]
    obs, _ = env.reset()
    assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8
    assert env.observation_space.contains(obs)
    obs, reward, terminated, truncated, _ = env.step(0)
    assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8
    steps, total, terminated = play_episode(env, np.random.default_rng(1))
    assert terminated  # a game over, not the time limit
    assert steps < 27_000
    if game == "pong":
        assert -21 <= total < 21 and total == int(total)  # unclipped: the score difference


def test_gym_frame_stack_shifts():
    env = envs.create_env("breakout", seed=0)
    obs, _ = env.reset()
    for k in range(1, 4):
        np.testing.assert_array_equal(obs[k], obs[0])  # the reset frame, repeated
    rng = np.random.default_rng(0)
    for _ in range(30):
        new, *_ = env.step(int(rng.integers(4)))
        np.testing.assert_array_equal(new[:-1], obs[1:])  # newest frame last
        obs = new
    assert not np.array_equal(obs[-1], obs[0])


@pytest.mark.parametrize("game", GAMES)
def test_gym_full_action_space(game):
    assert envs.create_env(game, full_action_space=True).action_space.n == 18
    assert envs.create_env(game, full_action_space=False).action_space.n == NUM_ACTIONS[game]


def test_gym_noop_starts():
    """The reset takes 1..noop_max no-op frames (none with noop_max=0)."""
    env = envs.create_env("breakout", noop_max=0, seed=1)
    assert [env.reset()[1]["episode_frame_number"] for _ in range(5)] == [0] * 5
    env = envs.create_env("breakout", noop_max=30, seed=1)
    frames = [env.reset()[1]["episode_frame_number"] for _ in range(12)]
    assert all(1 <= f <= 30 for f in frames)
    assert len(set(frames)) > 1
    env = envs.create_env("breakout", noop_max=3, seed=1)
    assert all(1 <= env.reset()[1]["episode_frame_number"] <= 3 for _ in range(12))


def test_gym_sticky_actions():
    """With probability 1 every action repeats the previous one, from the
    reset's NOOP on: random actions play exactly like NOOPs. With 0 they don't."""
    acts = np.random.default_rng(0).integers(0, 4, 60)
    noops = np.zeros(60, dtype=int)

    def run(p, actions):
        env = envs.create_env("breakout", noop_max=0, repeat_action_probability=p, seed=3)
        return trajectory(env, actions)

    np.testing.assert_array_equal(run(1.0, acts), run(1.0, noops))
    assert not np.array_equal(run(0.0, acts), run(0.0, noops))


def test_gym_seed():
    acts = np.random.default_rng(0).integers(0, 4, 100)

    def run(seed):
        return trajectory(envs.create_env("breakout", seed=seed), acts)

    np.testing.assert_array_equal(run(7), run(7))  # no-ops and sticky actions included
    # Unseeded envs draw different seeds.
    draws = {int(envs.create_env("pong").unwrapped.np_random.integers(2**62)) for _ in range(3)}
    assert len(draws) == 3


def test_gym_max_episode_frames():
    """Episodes are truncated after max_episode_frames // 4 agent steps (NOOPs
    never launch Breakout's ball, so nothing else ends them)."""
    env = envs.create_env("breakout", max_episode_frames=400, seed=0)
    for _ in range(2):
        env.reset()
        for step in range(1, 101):
            _, _, terminated, truncated, _ = env.step(0)
            assert not terminated
            assert truncated == (step == 100)


def test_gym_episodic_life():
    env = envs.create_env("breakout", episodic_life=True, repeat_action_probability=0.0, seed=2)
    rng = np.random.default_rng(2)
    _, info = env.reset()
    assert info["lives"] == 5
    # The first life lost ends an episode; the reset continues the same game.
    _, _, terminated = play_episode(env, rng)
    assert terminated and env.unwrapped.ale.lives() == 4
    _, info = env.reset()
    assert info["lives"] == 4
    lives_at_ends = [4]
    for _ in range(10):
        for _step in range(MAX_STEPS):
            _, _, terminated, truncated, info = env.step(int(rng.integers(4)))
            if terminated or truncated:
                break
        lives_at_ends.append(info["lives"])
        if info["lives"] == 0:
            break
        env.reset()
    assert lives_at_ends == [4, 3, 2, 1, 0]
    _, info = env.reset()  # the game is over: a new one
    assert info["lives"] == 5


# -- envpool backend ------------------------------------------------------------


@pytest.fixture
def pools():
    made = []

    def make(*args, **kwargs):
        pool = envs.create_envpool(*args, **kwargs)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.close()


def check_result(out, batch_size):
    assert set(out) == {"state", "reward", "done", "episode_return", "episode_length"}
    assert out["state"].shape == (batch_size, 4, 84, 84) and out["state"].dtype == torch.uint8
    assert out["reward"].shape == (batch_size,) and out["reward"].dtype == torch.float32
    assert out["done"].shape == (batch_size,) and out["done"].dtype == torch.bool
    assert out["episode_return"].shape == (batch_size,)
    assert out["episode_return"].dtype == torch.float32
    assert out["episode_length"].shape == (batch_size,)
    assert out["episode_length"].dtype == torch.int64


@pytest.mark.parametrize("game", GAMES)
def test_envpool_episodes_and_statistics(pools, game):
    """Random play on 2 batches (double-buffered) until every env finished an
    episode: shapes and dtypes; the first step and the step after each end are
    resets (reward 0, the 4 stacked frames equal); done is True exactly at the
    reset steps after an end, with episode_return and episode_length the sum of
    the rewards and the number of steps of the ended episode (0 elsewhere)."""
    batch_size, num_batches = 3, 2
    pool = pools(game, batch_size, num_batches, seed=11)
    assert pool.num_actions == NUM_ACTIONS[game]
    rng = np.random.default_rng(0)
    running = np.zeros((num_batches, batch_size))
    length = np.zeros((num_batches, batch_size), dtype=np.int64)
    first = np.ones(num_batches, dtype=bool)
    finished = np.zeros((num_batches, batch_size), dtype=int)
    returns = []
    futures = [pool.step(b, zeros(batch_size)) for b in range(num_batches)]
    for _ in range(MAX_STEPS):
        for b in range(num_batches):
            out = futures[b].result()
            check_result(out, batch_size)
            state = out["state"].numpy()
            reward = out["reward"].numpy()
            done = out["done"].numpy()
            for i in range(batch_size):
                if first[b] or done[i]:
                    assert reward[i] == 0
                    for k in range(1, 4):
                        np.testing.assert_array_equal(state[i, k], state[i, 0])
                if done[i]:
                    assert not first[b]
                    assert out["episode_return"][i].item() == pytest.approx(running[b, i])
                    assert out["episode_length"][i].item() == length[b, i]
                    returns.append(running[b, i])
                    finished[b, i] += 1
                else:
                    assert out["episode_return"][i].item() == 0
                    assert out["episode_length"][i].item() == 0
                if first[b] or done[i]:
                    running[b, i] = 0
                    length[b, i] = 0
                else:
                    running[b, i] += reward[i]
                    length[b, i] += 1
            first[b] = False
            action = rng.integers(0, pool.num_actions, batch_size)
            futures[b] = pool.step(b, actions_of(batch_size, action))
        if finished.min() >= 1:
            break
    else:
        raise AssertionError(f"not every env finished an episode in {MAX_STEPS} steps")
    for future in futures:
        future.result()
    assert any(r != 0 for r in returns)  # rewards happened and were counted
    if game == "pong":
        assert all(-21 <= r <= 21 for r in returns)


def test_envpool_matches_gym_backend(pools):
    """Without randomness (no sticky actions, exactly one no-op frame) both
    backends play Breakout identically: observations, rewards and the end."""
    options = {"noop_max": 1, "repeat_action_probability": 0.0}
    env = envs.create_env("breakout", seed=5, **options)
    pool = pools("breakout", 1, 1, seed=5, **options)
    obs, _ = env.reset()
    out = pool.step(0, zeros(1)).result()
    np.testing.assert_array_equal(out["state"][0].numpy(), obs)
    rng = np.random.default_rng(5)
    total = 0.0
    for step in range(1, MAX_STEPS):
        a = int(rng.integers(4))
        obs, reward, terminated, truncated, _ = env.step(a)
        out = pool.step(0, actions_of(1, [a])).result()
        np.testing.assert_array_equal(out["state"][0].numpy(), obs)
        assert out["reward"][0].item() == reward
        assert not out["done"][0].item()  # reported at the reset step
        total += reward
        if terminated or truncated:
            reset = pool.step(0, zeros(1)).result()
            assert reset["done"][0].item()
            assert reset["episode_return"][0].item() == total
            assert reset["episode_length"][0].item() == step
            break
    else:
        raise AssertionError("no episode end")


def test_envpool_first_step_resets_and_ignores_the_action(pools):
    pool = pools("breakout", 2, 2, seed=1)
    out = pool.step(0, actions_of(2, [1, 3])).result()
    check_result(out, 2)
    assert not out["done"].any() and (out["reward"] == 0).all()
    assert (out["episode_return"] == 0).all() and (out["episode_length"] == 0).all()
    state = out["state"]
    assert (state == state[:, :1]).all()  # the reset frame, 4 times
    # Batch 1 is independent: its first step is a reset too.
    assert not pool.step(1, zeros(2)).result()["done"].any()
    # The next step of batch 0 steps the game: the frame stack shifts.
    new = pool.step(0, zeros(2)).result()["state"]
    assert torch.equal(new[:, :-1], state[:, 1:])


def test_envpool_frame_stack_shifts(pools):
    pool = pools("pong", 2, 1, seed=3)
    state = pool.step(0, zeros(2)).result()["state"]
    for _ in range(40):
        out = pool.step(0, torch.randint(0, 6, (2,))).result()
        assert not out["done"].any()
        assert torch.equal(out["state"][:, :-1], state[:, 1:])
        state = out["state"]
    assert not torch.equal(state[:, -1], state[:, 0])


@pytest.mark.parametrize("game", GAMES)
def test_envpool_full_action_space(pools, game):
    assert pools(game, 1, 1, full_action_space=True).num_actions == 18
    pool = pools(game, 1, 1)
    assert pool.num_actions == NUM_ACTIONS[game] == pool.action_space.n
    pool.step(0, zeros(1)).result()
    with pytest.raises(RuntimeError, match=rf"in \[0, {NUM_ACTIONS[game]}\)"):
        pool.step(0, actions_of(1, [17]))


def test_envpool_sticky_actions(pools):
    acts = np.random.default_rng(0).integers(0, 4, (60, 2))

    def run(p, actions):
        pool = pools("breakout", 2, 1, seed=3, noop_max=1, repeat_action_probability=p)
        states = [pool.step(0, zeros(2)).result()["state"]]
        states += [pool.step(0, actions_of(2, a)).result()["state"] for a in actions]
        return torch.stack(states)

    assert torch.equal(run(1.0, acts), run(1.0, np.zeros_like(acts)))
    assert not torch.equal(run(0.0, acts), run(0.0, np.zeros_like(acts)))


def test_envpool_noop_starts(pools):
    """Pong's first frames differ with the number of no-ops: 8 envs with up to
    30 no-ops start in several states, with 0 (one no-op frame) in one."""

    def distinct_starts(noop_max):
        pool = pools("pong", 8, 1, seed=4, noop_max=noop_max, repeat_action_probability=0.0)
        states = pool.step(0, zeros(8)).result()["state"]
        return len({s.numpy().tobytes() for s in states})

    assert distinct_starts(0) == 1
    assert distinct_starts(30) > 1


def test_envpool_seed(pools):
    acts = np.random.default_rng(1).integers(0, 4, (50, 2))

    def run(seed):
        pool = pools("breakout", 2, 1, seed=seed)
        states = [pool.step(0, zeros(2)).result()["state"]]
        states += [pool.step(0, actions_of(2, a)).result()["state"] for a in acts]
        return torch.stack(states)

    assert torch.equal(run(9), run(9))


def test_envpool_max_episode_frames(pools):
    pool = pools("breakout", 2, 1, max_episode_frames=400, seed=0)
    pool.step(0, zeros(2)).result()
    for _ in range(1, 101):
        out = pool.step(0, zeros(2)).result()
        assert not out["done"].any()
    out = pool.step(0, zeros(2)).result()  # the reset step after step 100
    assert out["done"].all() and (out["state"] == out["state"][:, :1]).all()
    assert out["episode_length"].tolist() == [100, 100]


def test_envpool_episodic_life(pools):
    """A lost life ends an episode (at the step the gymnasium backend, playing
    the same deterministic game, loses it); the reset step that follows
    continues the game instead of starting a new one."""
    options = {"noop_max": 1, "repeat_action_probability": 0.0}
    env = envs.create_env("breakout", seed=6, **options)
    pool = pools("breakout", 1, 1, seed=6, episodic_life=True, **options)
    env.reset()
    start = pool.step(0, zeros(1)).result()["state"]
    rng = np.random.default_rng(6)
    for step in range(1, MAX_STEPS):
        a = int(rng.integers(4))
        _, _, terminated, truncated, info = env.step(a)
        out = pool.step(0, actions_of(1, [a])).result()
        assert not (terminated or truncated)
        assert not out["done"][0].item()
        if info["lives"] < 5:
            lost_at = step
            break
    else:
        raise AssertionError("no life lost")
    after = pool.step(0, zeros(1)).result()  # the reset step: the life's end
    assert after["done"].all() and after["reward"][0].item() == 0
    assert after["episode_length"][0].item() == lost_at
    assert not torch.equal(after["state"], start)  # a new game would start exactly so
    fresh = pools("breakout", 1, 1, seed=6, episodic_life=False, **options)
    assert torch.equal(fresh.step(0, zeros(1)).result()["state"], start)


def test_envpool_bad_actions(pools):
    pool = pools("breakout", 4, 2)
    with pytest.raises(RuntimeError, match=r"action shape must be \[4\].*got \[3\]"):
        pool.step(0, zeros(3))
    with pytest.raises(RuntimeError, match=r"action shape must be \[4\].*got \[4, 1\]"):
        pool.step(0, torch.zeros(4, 1, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="dtype must be torch.int64, got torch.int32"):
        pool.step(0, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="dtype must be torch.int64, got torch.float32"):
        pool.step(0, torch.zeros(4))
    with pytest.raises(RuntimeError, match="dtype must be torch.int64, got numpy int32"):
        pool.step(0, np.zeros(4, dtype=np.int32))
    with pytest.raises(RuntimeError, match="must be a torch.Tensor or numpy array, got list"):
        pool.step(0, [0, 0, 0, 0])
    with pytest.raises(RuntimeError, match=r"actions must be in \[0, 4\)"):
        pool.step(0, actions_of(4, [0, 1, 2, -1]))
    with pytest.raises(IndexError, match="batch_index 2 out of range"):
        pool.step(2, zeros(4))
    # None of these started a step: the pool still works, numpy actions too.
    out = pool.step(0, np.zeros(4, dtype=np.int64)).result()
    check_result(out, 4)


def test_envpool_one_step_in_flight_per_batch(pools):
    pool = pools("breakout", 2, 2)
    first = pool.step(0, zeros(2))
    with pytest.raises(RuntimeError, match="batch 0 already has a step in flight"):
        pool.step(0, zeros(2))
    other = pool.step(1, zeros(2))  # another batch may step meanwhile
    out = first.result()
    assert first.done()
    check_result(out, 2)
    assert torch.equal(first.result()["state"], out["state"])  # result() again: the same
    pool.step(0, zeros(2)).result(timeout=300)
    other.result()


def test_envpool_results_are_not_reused(pools):
    pool = pools("pong", 2, 1)
    first = pool.step(0, zeros(2)).result()
    kept = first["state"].clone()
    for _ in range(20):
        pool.step(0, torch.randint(0, 6, (2,))).result()
    assert torch.equal(first["state"], kept)


def test_envpool_close_and_context_manager():
    with envs.create_envpool("breakout", 2, 1) as pool:
        pool.step(0, zeros(2)).result()
        pool.step(0, zeros(2))  # in flight at close: waited for
    with pytest.raises(RuntimeError, match="closed"):
        pool.step(0, zeros(2))
    pool.close()  # idempotent


@pytest.mark.parametrize(
    "limit, env",
    [
        ("os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n", {}),
        ("", {"SLURM_CPUS_PER_TASK": "1"}),  # a SLURM task of one CPU, not bound to it
    ],
    ids=["affinity", "slurm-task"],
)
def test_envpool_threads_follow_the_cores_this_process_may_use(limit, env):
    """On a machine with more cores than the process may use (taskset, SLURM's
    binding, or its SLURM task's CPUs), envpool gets a thread per such core, not
    per core of the machine."""
    code = (
        "import os\n" + limit + "import moolib.envs as envs\n"
        "with envs.create_envpool('pong', 4, 1) as pool:\n"
        "    print(pool._envs[0].config['num_threads'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env={**os.environ, **env},
    )
    assert out.stdout.split() == ["1"]


def test_envpool_rejects_non_atari(pools):
    with pytest.raises(ValueError, match="Atari games only"):
        envs.create_envpool("cartpole", 1, 1)
    with pytest.raises(ValueError, match="batch_size"):
        envs.create_envpool("pong", 0, 1)
    with pytest.raises(ValueError, match="num_batches"):
        envs.create_envpool("pong", 1, 0)


def test_a_decorrelated_env_starts_after_its_random_steps_once():
    """env.decorrelate_steps: the first reset takes the env's drawn number of random
    actions (uniform below the bound); later resets are the env's own."""
    from helpers.toy_envs import LineEnv
    from moolib.envs.decorrelate import DecorrelatedStart

    drawn = set()
    for seed in range(20):
        env = DecorrelatedStart(LineEnv(), 50, np.random.default_rng(seed))
        assert 0 <= env.start_steps < 50
        drawn.add(env.start_steps)
        obs, _ = env.reset()
        assert obs[1] == env.start_steps  # LineEnv counts its steps since the reset
        env.step(1)
        obs, _ = env.reset()
        assert obs.tolist() == [0.0, 0.0]
    assert len(drawn) > 5
    with pytest.raises(ValueError, match="decorrelate_steps"):
        DecorrelatedStart(LineEnv(), 0)
