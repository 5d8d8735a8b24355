"""moolib.envs.registry: one EnvSpec per env family, through which every env name
resolves (create_env, moolib-run's checks, the trainers' pools, the config's games)."""

from __future__ import annotations

import inspect

import gymnasium
import moolib.envs as envs
import pytest
from moolib.envs import registry
from moolib.envs.mujoco import MUJOCO_ENVS
from moolib.launch import config as config_lib


def _keyword_parameters(make, skip=("self", "name", "batch_size", "num_batches")):
    return [p for p in inspect.signature(make).parameters if p not in skip]


@pytest.mark.parametrize("spec", envs.env_specs(), ids=lambda s: s.family)
def test_each_familys_options_schema_is_what_its_make_takes(spec):
    if spec.options is None:  # gymnasium ids: whatever gymnasium.make or the factory takes
        assert spec.option_names() is None
        return
    assert spec.option_names() == _keyword_parameters(spec.make)
    if spec.backend is not None:
        init = (
            spec.backend.make.__init__ if inspect.isclass(spec.backend.make) else spec.backend.make
        )
        assert spec.option_names(spec.backend.name) == _keyword_parameters(init)


@pytest.mark.parametrize(
    "name, family",
    [
        ("cartpole", "classic"),
        ("cartpole-novel", "classic"),
        ("breakout", "atari"),
        ("ALE/SpaceInvaders-v5", "atari"),
        ("minatar-breakout", "minatar"),
        ("MinAtar-Space-Invaders", "minatar"),
        ("gym:Acrobot-v1", "gym"),
    ],
)
def test_a_name_resolves_to_one_family(name, family):
    assert envs.find_env_spec(name).family == family
    assert envs.env_spec(name).family == family


def test_an_unknown_name_resolves_to_none_and_create_env_names_close_matches():
    for name in ("zzzz", "minatar-pong", "gym:"):
        assert envs.find_env_spec(name) is None
    with pytest.raises(ValueError, match="Did you mean: breakout"):
        envs.env_spec("breakot")


def test_list_envs_shows_the_families_in_their_order():
    names = envs.list_envs()
    assert names[:3] == ["cartpole", "cartpole-novel", "pendulum"]
    minatar, mujoco = len(envs.MINATAR_ENVS), len(MUJOCO_ENVS)
    assert names[3 : 3 + minatar] == list(envs.MINATAR_ENVS)
    assert names[3 + minatar : 3 + minatar + mujoco] == list(MUJOCO_ENVS)
    assert names[3 + minatar + mujoco :] == list(envs.ATARI_GAMES)


def test_the_game_suites_and_backends():
    assert registry.game_suite_of("minatar-breakout").label == "MinAtar"
    assert registry.game_suite_of("breakout").label == "Atari"
    assert registry.backend_names() == ("gymnasium", "envpool")
    assert registry.find_backend("envpool").serves == "Atari games"
    assert registry.find_backend("gymnasium") is None


def test_a_family_of_ones_own_is_one_registration(monkeypatch):
    monkeypatch.setattr(registry, "_specs", dict(registry._specs))

    def make_corridor(name, *, length=5, seed=None):
        return gymnasium.make("CartPole-v1")

    spec = envs.register_env(
        envs.EnvSpec(
            family="corridor",
            description="a test family",
            names=("corridor",),
            canonical=lambda name: name if name == "corridor" else None,
            make=make_corridor,
            options=(envs.EnvOption("length", 5), envs.EnvOption("seed")),
        )
    )
    assert envs.find_env_spec("corridor") is spec and "corridor" in envs.list_envs()
    env = envs.create_env("corridor", length=3)
    assert env.action_space.n == 2
    env.close()
    with pytest.raises(ValueError, match="already registered"):
        envs.register_env(spec)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["env=minatar-breakout", "env.options.sticky_action_prob=1.5"],
            "env.options.sticky_action_prob=1.5: ValueError: sticky_action_prob must be in "
            "[0, 1], got 1.5",
        ),
        (
            ["env=breakout", "env.options.noop_max=-1"],
            "env.options.noop_max=-1: ValueError: noop_max must be an int >= 0, got -1",
        ),
        (
            ["env=breakout", "env.options.full_action_space=no"],
            "env.options.full_action_space='no': ValueError: full_action_space must be true "
            "or false, got 'no'",
        ),
    ],
)
def test_the_config_checks_take_the_options_schemas_checks(compose_config, overrides, message):
    with pytest.raises(config_lib.ConfigError) as info:
        config_lib.validate(compose_config("agent=a2c", *overrides))
    assert str(info.value) == message
