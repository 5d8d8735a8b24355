"""What ``moolib-run`` checks before a run starts, so that every mistake a user can
make stops it with one line (exit 2) and leaves nothing behind.

Before Hydra creates any folder, each job of the command line (one, or every
point of a ``-m`` sweep) is composed with Hydra's compose API and planned:

- the overrides parse, name existing config group options and known keys (a
  ``+key`` that nothing reads is refused too, with the nearest known key);
- a savedir that holds a ``config.yaml`` is resumed from it (``resume.py``);
- the values pass ``config.validate``;
- SLURM's commands are there (``scaling=slurm``), the savedir can be written and
  no other run is in it (``savedir_lock.py``),
  the env can be made with its options, ``agent.network`` takes its
  observations, the model fits the savedir's checkpoint, ``broker=``
  answers (bounded wait), and the pip extras the run uses are installed.

The task function plans its job again (cheap, without the probes): the
pre-flight only decides whether the run may start.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import moolib.conf
from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException, MissingConfigException
from moolib.conf.schema.scaling import scaling_spec
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from moolib._extras import MissingExtraError

from . import config as config_lib
from . import resume as resume_lib
from . import savedir_lock
from .config import ConfigError, RunConfig, one_line
from .resume import Resume

CONF_DIR = Path(next(iter(moolib.conf.__path__)))


def parse_overrides(lines: list[str]) -> list[Override]:
    """The command line's overrides, parsed as Hydra parses them."""
    parser = OverridesParser.create()
    parsed = []
    for line in lines:
        try:
            parsed.extend(parser.parse_overrides([line]))
        except HydraException as e:
            key, _, value = line.partition("=")
            home = _home_spelled_out(value)
            if home is not None:
                # zsh, and bash in POSIX mode, leave key=~/x unexpanded.
                raise ConfigError(
                    f"bad override '{line}': the shell did not expand ~ here, and Hydra "
                    f"cannot read it: write {key}={home}"
                ) from e
            raise ConfigError(f"bad override '{line}': {one_line(str(e))}") from e
    return parsed


def expand(overrides: list[Override], multirun: bool) -> list[list[str]]:
    """The override lines of each job, in Hydra's order (a sweep's job numbers)."""
    if not multirun:
        return [[o.input_line or "" for o in overrides]]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    try:
        return BasicSweeper.split_arguments(overrides, None)[0]
    except HydraException as e:
        raise ConfigError(one_line(str(e))) from e


def _home_spelled_out(value: object) -> str | None:
    """``~`` or ``~/x`` written as ``$HOME`` or ``$HOME/x`` (None for anything else)."""
    if isinstance(value, str) and (value == "~" or value.startswith("~/")):
        return "$HOME" + value[1:]
    return None


def savedir_of(overrides: list[Override]) -> str | None:
    """The ``savedir=`` the command line gives (None: Hydra picks a fresh folder)."""
    for o in overrides:
        if o.key_or_group == "savedir" and o.type != OverrideType.DEL and not o.is_sweep_override():
            value = o.value()
            home = _home_spelled_out(value)
            if home is not None:
                # Not expanded by anyone: the run would write into a folder named '~'.
                raise ConfigError(
                    f"savedir={value}: a path starting with ~ is not expanded here (it "
                    f"would make a folder named '~' in this directory): write savedir={home}"
                )
            return None if value is None else str(value)
    return None


def _group_lines(lines: list[str]) -> list[str]:
    out = []
    for o in parse_overrides(lines):
        if resume_lib.is_group_override(o) or resume_lib.is_hydra_override(o):
            out.append(o.input_line or "")
    return out


def schema(lines: list[str], extra: list[str] | None = None) -> DictConfig | None:
    """The config of the groups these overrides pick, without their values: every
    key a run of them reads. None if even that does not compose."""
    try:
        return compose("config", overrides=[*(extra or []), *_group_lines(lines)])
    except (HydraException, OmegaConfBaseException, ConfigError):
        return None


# What users of other libraries call moolib-run's agents.
_GROUP_ALIASES = {"agent": {"impala": "vtrace", "dqn": "apex", "apex_dqn": "apex"}}


def _from_gymnasium_id(option: str, options: list[str]) -> str | None:
    """The env option a gymnasium id names (ALE/Pong-v5, PongNoFrameskip-v4,
    CartPole-v1: pong, pong, cartpole), if there is one."""
    base = re.sub(r"-v\d+$", "", option.rpartition("/")[2])
    base = re.sub(r"(NoFrameskip|Deterministic)$", "", base)
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", base).lower()
    for name in (snake, snake.replace("_", "")):
        if name != option and name in options:
            return name
    return None


def hydra_message(e: BaseException, lines: list[str], extra: list[str] | None = None) -> str:
    """One line for a Hydra composition error, naming the key or option at fault."""
    text = str(e)
    missing = re.search(r"Could not (?:find|load) '([\w/]+)/([^']+)'", text)
    if isinstance(e, MissingConfigException) or missing:
        if missing:
            group, option = missing.group(1), missing.group(2)
            if group.startswith("env/"):  # env=ALE/Pong-v5: Hydra reads a group env/ALE
                group, option = "env", f"{group[4:]}/{option}"
            options = moolib.conf.group_options(group)
            if group == "env":
                known_as = _from_gymnasium_id(option, options)
            else:
                known_as = _GROUP_ALIASES.get(group, {}).get(option.lower())
            close = difflib.get_close_matches(option.lower(), options, n=1, cutoff=0.5)
            near = known_as or (close[0] if close else None)
            hint = f"; nearest: {near}" if near else ""
            if known_as:
                hint += f" ({option} is {group}={known_as} here)"
            # Hydra's own groups (hydra/launcher) have no files of ours.
            listed = ", ".join(moolib.conf.file_options(group) or options)
            suites = moolib.conf.registered_suites(group)
            if suites.get("Atari"):
                listed += (
                    f", or any of {len(suites['Atari'])} Atari games such as breakout, pong "
                    "(moolib.envs.list_envs())"
                )
            listed += moolib.conf.listed_suites(group)
            return f"{group}={option}: no such {group} option{hint} (options: {listed})"
    cause = e.__cause__
    full_key = getattr(cause, "full_key", None)
    if full_key and "not in struct" in str(cause):
        return str(unknown_key(full_key, schema(lines, extra)))
    if isinstance(cause, OmegaConfBaseException):
        text = f"{text}: {cause}"
    return one_line(text)


def unknown_key(key: str, known: DictConfig | None, where: str = "") -> ConfigError:
    """The error for a key nothing reads: the options of its group that have it
    (``scaling.actors`` under scaling=single), else the nearest known key."""
    parent = key.rpartition(".")[0]
    if resume_lib.under_free_form(key) and known is not None and not where:
        if not OmegaConf.select(known, parent):
            # An empty pass-through map (a gymnasium env's options): Hydra wants its
            # keys added, and there is no nearest to offer.
            return ConfigError(
                f"unknown key {key}: {parent} is handed as it is to what reads it, and a "
                f"key it does not have yet is added with a plus: +{key}=..."
            )
    group, _, below = key.partition(".")
    others = moolib.conf.options_setting(group, below) if below else []
    if not others:
        return resume_lib.unknown_key_error(
            key, resume_lib.known_keys(known) if known is not None else [], where
        )
    chosen = OmegaConf.select(known, f"{group}.name") if known is not None else None
    if chosen:
        where += f" in {group}={chosen}"
    have = " and ".join(f"{group}={o}" for o in others)
    return ConfigError(
        f"unknown key {key}{where}: {have} {'has' if len(others) == 1 else 'have'} it"
    )


# Compositions of this process, by their overrides: the pre-flight composes each job
# and the task function plans it again once Hydra has set it up; a composition costs
# about as much CPU as the rest of the launcher's checks together.
_composed: dict[tuple[str, ...], DictConfig] = {}


def compose_job(lines: list[str], extra: list[str] | None = None) -> DictConfig:
    """Hydra's composition of one job (``extra`` first), hydra node included (a copy:
    the same overrides compose once per process)."""
    overrides = (*(extra or []), *lines)
    if overrides not in _composed:
        try:
            _composed[overrides] = compose(
                "config", overrides=list(overrides), return_hydra_config=True
            )
        except (HydraException, OmegaConfBaseException) as e:
            raise ConfigError(hydra_message(e, lines, extra)) from e
    return copy.deepcopy(_composed[overrides])


def _without_hydra(cfg: DictConfig) -> DictConfig:
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    out.pop("hydra", None)
    OmegaConf.set_struct(out, True)
    return out


def check_added_keys(overrides: list[Override], lines: list[str]) -> None:
    """Refuses a ``+key``/``++key`` that adds a key no code reads (Hydra allows it)."""
    adds = [
        o
        for o in overrides
        if o.type in (OverrideType.ADD, OverrideType.FORCE_ADD)
        and not resume_lib.is_group_override(o)
        and not resume_lib.is_hydra_override(o)
    ]
    if not adds:
        return
    known = schema(lines)
    for o in adds:
        key = o.key_or_group
        if known is not None and resume_lib.has_key(known, key):
            continue
        if resume_lib.under_free_form(key):
            continue
        raise unknown_key(key, known, f" ('{o.input_line}' adds it, but nothing reads it)")


@dataclass
class Job:
    """One run of the command line, as planned."""

    lines: list[str]  # its overrides
    config: DictConfig  # what it trains with (savedir and group filled in by prepare)
    savedir: Path  # where it writes
    resume: Resume | None  # set when the savedir holds an experiment
    state: dict | None = None  # the savedir's newest intact checkpoint, if any
    # The saved run's group choices the command line does not make (``agent=apex``):
    # its overrides compose against them, here and in Hydra's own composition.
    choices: list[str] = field(default_factory=list)


def plan(
    lines: list[str], savedir: Path | None = None, job_num: int = 0, multirun: bool = False
) -> Job:
    """Composes one job. ``savedir``: where it writes (None: the ``savedir=`` of its
    overrides, else the folder Hydra will pick). Raises ConfigError."""
    overrides = parse_overrides(lines)
    if savedir is None:
        given = savedir_of(overrides)
        if given is not None and "${" not in given:
            savedir = Path(given) / str(job_num) if multirun else Path(given)
    saved = resume_lib.load_saved(savedir) if savedir is not None else None
    if saved is None:
        composed = compose_job(lines)
        check_added_keys(overrides, lines)
        if savedir is None:
            dirs = composed.hydra.sweep if multirun else composed.hydra.run
            savedir = Path(str(dirs.dir))
            savedir = savedir / str(job_num) if multirun else savedir
        return Job(lines, _without_hydra(composed), savedir, None)
    picked = {o.key_or_group for o in overrides if resume_lib.is_group_override(o)}
    extra = resume_lib.saved_choices(saved, picked)
    composed = compose_job(lines, extra)
    resume = resume_lib.merge(savedir, saved, _without_hydra(composed), overrides)
    state = None
    found = resume_lib.checkpoint_state(savedir)
    if found is not None:
        state, resume.fallback = found
        resume.step = int(state["steps"])
    return Job(lines, resume.config, savedir, resume, state, extra)


def notes(job: Job, cfg: RunConfig) -> list[str]:
    """What moolib-run says before the run starts about settings that do not stop it
    (``cfg``: the job's checked config)."""
    return unused_scaling_keys(job, cfg) + replay_warmup_notes(job, cfg)


def unused_scaling_keys(job: Job, cfg: RunConfig) -> list[str]:
    """Notes on a process count the command line sets that this run's agent does not
    read: ``scaling.actors`` with an on-policy agent, ``scaling.peers`` with an off-policy
    one. Notes, not errors: a sweep over agents may set both."""
    from moolib.agents.registry import agent_names, runtime_of, runtime_of_agent

    runtime = runtime_of(cfg)
    used = runtime.processes
    given = {o.key_or_group for o in parse_overrides(job.lines)}
    if not hasattr(cfg.scaling, used):
        return []
    said = []
    for unused in sorted({runtime_of_agent(n).processes for n in agent_names()} - {used}):
        if f"scaling.{unused}" not in given:
            continue
        readers = " and ".join(n for n in agent_names() if runtime_of_agent(n).processes == unused)
        said.append(
            f"scaling.{unused} is not used by agent={cfg.agent.name}, which runs "
            f"scaling.{used}={getattr(cfg.scaling, used)} {runtime.processes_described} "
            f"(scaling.{unused} is for {readers})"
        )
    return said


def replay_warmup_notes(job: Job, cfg: RunConfig) -> list[str]:
    """A note when an off-policy run ends before its learner starts: the steps it has
    left do not fill the replay to ``agent.min_replay_size``. A note, not an error: a
    short run that only tests the plumbing is a fair thing to ask for."""
    from moolib.agents.registry import QConfig

    agent = cfg.agent
    if not isinstance(agent, QConfig):
        return []
    per_item = agent.steps_per_item()
    warmup = agent.min_replay_size * per_item
    total = cfg.total_steps
    resumed = job.resume.step if job.resume is not None and job.resume.step else 0
    # A checkpoint without the replay (save_replay=false) starts it empty again.
    left = total - resumed if not agent.save_replay else total
    if left >= warmup:
        return []
    steps = "" if per_item == 1 else f", a new one every {per_item} steps of an env"
    since = f" from step {resumed:,} (the replay is not in the checkpoint)" if left < total else ""
    return [
        f"total_steps={total:,} ends before the learner starts{since}: it waits for "
        f"agent.min_replay_size={agent.min_replay_size:,} {agent.item_name}{steps}, about "
        f"{warmup:,} env steps"
    ]


# -- checks that look at the machine -------------------------------------------------------


def check_savedir(savedir: Path) -> None:
    """Raises ConfigError unless ``savedir`` is (or can be made) a writable folder.
    Writes nothing that stays: a probe file, at once removed."""
    path = Path(savedir).absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is not a directory" if existing == path else f"cannot be made: {existing} is a file"
        raise ConfigError(f"savedir={savedir}: {what}")
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".moolib-run-probe-"):
            pass
    except OSError as e:
        why = e.strerror or str(e)
        where = "is not writable" if existing == path else f"cannot be made in {existing}"
        raise ConfigError(f"savedir={savedir}: {where} ({why})") from e


def check_not_a_sweep(savedir: Path, multirun: bool) -> None:
    """A sweep's folder is not a run's savedir, and a run's savedir holds no sweep."""
    path = Path(savedir)
    if multirun:
        if (path / config_lib.CONFIG_FILE).is_file():
            raise ConfigError(
                f"savedir={savedir} holds a single run (its config.yaml); a -m sweep needs a "
                "folder of its own"
            )
        return
    if path.is_dir() and not (path / config_lib.CONFIG_FILE).exists():
        points = sorted(p.name for p in path.iterdir() if (p / config_lib.CONFIG_FILE).is_file())
        if points:
            raise ConfigError(
                f"savedir={savedir} is a sweep's folder (runs in {', '.join(points[:5])}): resume "
                f"one run with savedir={path / points[0]}, or the sweep with -m"
            )


_env_probes: dict[str, tuple[tuple[int, ...], Any]] = {}


def probe_env(cfg: RunConfig) -> tuple[tuple[int, ...], Any]:
    """Makes the config's env once (the names of its options checked against its
    family's schema first, their values by the env); returns its observation shape and
    action space (an ``ActionSpace``). Raises ConfigError naming the key."""
    options = cfg.env.option_values()
    key = json.dumps([cfg.env.name, cfg.env.backend, options], sort_keys=True, default=str)
    if key in _env_probes:
        return _env_probes[key]
    from moolib.envs import find_env_spec
    from moolib.envs import probe_env as probe

    backend = str(cfg.env.backend)
    spec = find_env_spec(str(cfg.env.name))
    unknown = spec.unknown_options(options, backend) if spec is not None else []
    if spec is not None and unknown:
        # The schema's names, before any env is made (a gymnasium env's options are
        # its own: it names what it does not take).
        known = [f"env.options.{k}" for k in spec.option_names(backend) or ()]
        raise resume_lib.unknown_key_error(
            f"env.options.{unknown[0]}", known, f" ({cfg.env.name} has no such option)"
        )
    try:
        found = probe(str(cfg.env.name), backend, options)
    except MissingExtraError as e:
        raise ConfigError(f"env={cfg.env.name}: {e}") from e
    except Exception as e:  # noqa: BLE001 - whatever the env refuses is the user's to fix
        unexpected = re.search(r"unexpected keyword argument '(\w+)'", str(e))
        if isinstance(e, TypeError) and unexpected:
            raise resume_lib.unknown_key_error(
                f"env.options.{unexpected.group(1)}", [], f" ({cfg.env.name} has no such option)"
            ) from e
        named = [k for k in options if re.search(rf"\b{re.escape(str(k))}\b", str(e))]
        if named:
            where = f"env.options.{named[0]}={options[named[0]]!r}"
        else:
            where = f"env={cfg.env.name}" + (f" with env.options {options}" if options else "")
        raise ConfigError(f"{where}: {type(e).__name__}: {one_line(str(e))}") from e
    _env_probes[key] = found
    return found


_brokers_seen: set[str] = set()


def check_broker(cfg: RunConfig) -> None:
    """With ``broker=host:port``: returns once that broker answers, or raises
    ConfigError after ``group_timeout`` seconds (``scaling.broker_timeout`` on SLURM)."""
    address = cfg.broker
    if not address or address in _brokers_seen:
        return
    from .local import check_broker as probe

    timeout, which = cfg.scaling.broker_wait(cfg)
    try:
        probe(str(address), timeout)
    except TimeoutError as e:
        raise ConfigError(
            f"broker={address}: no broker answered there within {timeout:g} s ({which}); start "
            "one there (moolib-broker HOST:PORT) or leave broker unset to start one with the run"
        ) from e
    except Exception as e:  # noqa: BLE001 - an address Rpc.connect refuses outright
        raise ConfigError(f"broker={address}: {one_line(str(e))}") from e
    _brokers_seen.add(address)


def check_env_name(job: Job) -> None:
    """``env.name`` follows ``env.game`` (``minatar-<game>`` for MinAtar; a gymnasium
    env's ``env.id``): set on the command line to anything else, it would make
    another suite's env with this config's options (``env=minatar env.name=breakout``
    is Atari's Breakout)."""
    overrides = parse_overrides(job.lines)
    keys = [k for k in ("game", "id") if k in job.config.env]
    if not keys or not any(o.key_or_group == "env.name" for o in overrides):
        return
    rest = [
        line for line, o in zip(job.lines, overrides, strict=True) if o.key_or_group != "env.name"
    ]
    env = compose_job(rest, job.choices).env
    with open_dict(env):
        env[keys[0]] = job.config.env[keys[0]]
    if str(env.name) != str(job.config.env.name):
        raise config_lib.env_name_error(str(job.config.env.name), str(env.name), keys[0])


def check_network(cfg: RunConfig, shape: tuple[int, ...]) -> None:
    """``agent.network`` takes the env's observations (of ``shape``): the convolutional
    networks need images, large enough for their convolutions."""
    from moolib.agents.nets.models import observations_unfit, resolve_network

    network = resolve_network(cfg.agent.network, shape)
    unfit = observations_unfit(network, shape)
    if unfit:
        raise ConfigError(
            f"agent.network={cfg.agent.network} cannot take the observations of "
            f"env={cfg.env.name}, of shape {shape}: {network} {unfit}; agent.network=auto "
            f"picks one that does ({resolve_network('auto', shape)} here)"
        )


def check_actions(cfg: RunConfig, actions: Any) -> None:
    """The agent learns in the env's actions (an ``ActionSpace``): the Q-learners pick
    among discrete ones only."""
    from moolib.agents.registry import get_agent

    if actions.continuous and not get_agent(cfg.agent.name).continuous_actions:
        able = " or ".join(f"agent={n}" for n in _agents_with_continuous_actions())
        raise ConfigError(
            f"agent={cfg.agent.name} cannot act in env={cfg.env.name}: its actions are "
            f"{actions}, and {cfg.agent.name} rates each of a finite set of actions "
            f"({able} learn continuous actions)"
        )


def _agents_with_continuous_actions() -> list[str]:
    from moolib.agents.registry import agent_names, get_agent

    return [n for n in agent_names() if get_agent(n).continuous_actions]


def check_fits(job: Job, cfg: RunConfig) -> None:
    """The env of ``cfg`` (the job's checked config) can be made with its options, the
    agent acts in its actions, the network takes its observations, and (on resume)
    the model loads the savedir's checkpoint."""
    check_env_name(job)
    shape, actions = probe_env(cfg)
    check_actions(cfg, actions)
    check_network(cfg, shape)
    if job.resume is not None and job.state is not None:
        resume_lib.check_model_fits(job.resume, cfg.agent, job.state, shape, actions)


def check_extras(cfg: RunConfig) -> None:
    """The optional packages the run of ``cfg`` uses are installed (the env's are
    checked by making it)."""
    from moolib.agents.runtime.logger import import_wandb
    from moolib.agents.runtime.tensorboard_log import import_tensorboard

    for enabled, load in (
        (cfg.wandb.enabled, import_wandb),
        (cfg.tensorboard.enabled, import_tensorboard),
    ):
        if enabled:
            try:
                load()
            except MissingExtraError as e:
                raise ConfigError(str(e)) from e


def check_can_start(job: Job, cfg: RunConfig) -> None:
    """The checks that look at the machine around the run of ``cfg`` (the job's checked
    config): the packages it needs, SLURM's commands (``scaling=slurm``), its savedir
    (writable, no other run in it), its broker."""
    check_extras(cfg)
    check_machine = scaling_spec(cfg.scaling.name).check_machine
    if check_machine is not None:
        check_machine(cfg)
    check_savedir(job.savedir)
    savedir_lock.check_free(job.savedir)
    check_broker(cfg)


def config_for_display(job: Job) -> str:
    """``--cfg job`` of a resume: the config the run would train with."""
    cfg: Any = job.config
    with open_dict(cfg):
        cfg.savedir = str(job.savedir)
    return OmegaConf.to_yaml(cfg)
