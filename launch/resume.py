"""A savedir owns its config.

``moolib-run savedir=X`` where ``X/config.yaml`` exists resumes the experiment X
holds: its saved config, with the command line's overrides applied on top. An
override that cannot apply to X's checkpoint (another agent or env, a model
that does not fit it) is refused before anything is written; every resume is
logged in ``X/resumes.yaml`` with the settings it changed (old and new value),
so the original settings are never lost.
"""

from __future__ import annotations

import datetime
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.override_parser.types import Override, OverrideType
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from . import savedir_lock
from .config import CONFIG_FILE, ConfigError, one_line

if TYPE_CHECKING:
    from moolib.agents.registry import AgentConfig

RESUMES_FILE = "resumes.yaml"
CHECKPOINT_FILE = "checkpoint.pt"
# Config groups of conf/: ``agent=a2c`` picks a file, it does not set a value.
GROUPS = ("agent", "env", "scaling", "tuning")
# Maps handed on as they are (to the env, to sbatch): any key under them is read.
FREE_FORM = ("env.options", "scaling.additional_parameters")
# Keys that do not describe the experiment (where it lives), not listed as changes.
NOT_SETTINGS = ("savedir",)
# Abbreviations people type for keys the config spells out.
_ABBREVIATIONS = {
    "lr": "learning_rate",
    "bs": "batch_size",
    "eps": "epsilon",
    "gamma": "discounting",
    "num_envs": "actor_batch_size",
}


def is_hydra_override(override: Override) -> bool:
    """``hydra.*`` settings and ``hydra/...`` groups configure Hydra, not the run."""
    key = override.key_or_group
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def is_group_override(override: Override) -> bool:
    """``agent=a2c``, ``~tuning``: picks (or drops) a config group's option."""
    return override.key_or_group in GROUPS or "/" in override.key_or_group


def known_keys(cfg: DictConfig) -> list[str]:
    """Every dotted key of ``cfg`` (inner nodes and leaves), ``hydra`` excluded."""
    keys: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, DictConfig):
            for k in node.keys():
                full = f"{prefix}{k}"
                if full == "hydra":
                    continue
                keys.append(full)
                walk(node._get_node(k), f"{full}.")

    walk(cfg, "")
    return keys


def nearest_key(key: str, known: list[str]) -> str | None:
    """The known key closest to ``key`` (difflib), for "did you mean" messages."""
    if not known:
        return None
    parent, _, leaf = key.rpartition(".")
    leaf = _ABBREVIATIONS.get(leaf, leaf)
    wanted = f"{parent}.{leaf}" if parent else leaf
    leaves = {k: k.rpartition(".")[2] for k in known}

    def score(k: str) -> float:
        whole = difflib.SequenceMatcher(None, wanted, k).ratio()
        # A right leaf under another parent ("agent.learning_rate") is close too.
        return max(whole, difflib.SequenceMatcher(None, leaf, leaves[k]).ratio() - 0.01)

    return max(known, key=score)


def unknown_key_error(key: str, known: list[str], where: str = "") -> ConfigError:
    """ "unknown key K; nearest known key: N": the error for a key nothing reads."""
    near = nearest_key(key, known)
    nearest = f"; nearest known key: {near}" if near else ""
    return ConfigError(f"unknown key {key}{where}{nearest} (moolib-run --cfg job lists every key)")


def under_free_form(key: str) -> bool:
    """Whether ``key`` lies inside one of the pass-through maps (``env.options.*``)."""
    return any(key.startswith(f"{m}.") for m in FREE_FORM)


def has_key(cfg: DictConfig, key: str) -> bool:
    """Whether ``key`` (dotted) exists in ``cfg``, even when its value is null."""
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node._get_node(part)
    return True


def plain(value: Any) -> Any:
    """A config value as plain Python (nested configs as dicts and lists)."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def load_saved(savedir: Path) -> DictConfig | None:
    """The config ``savedir`` was started with (its latest), or None if it holds none."""
    path = Path(savedir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        cfg = OmegaConf.load(path)
    except Exception as e:  # noqa: BLE001 - any parse error: the file is not ours
        # YAML's errors span lines (the problem, then where).
        raise ConfigError(f"savedir={savedir}: {path} cannot be read: {one_line(e)}") from e
    if not isinstance(cfg, DictConfig) or "agent" not in cfg or "env" not in cfg:
        raise ConfigError(
            f"savedir={savedir}: {path} is not a moolib-run config (no agent and env); "
            "give another savedir"
        )
    OmegaConf.set_struct(cfg, True)
    return cfg


def saved_choices(saved: DictConfig, given: set[str]) -> list[str]:
    """Overrides that select the saved run's agent, env and scaling groups (those the
    command line does not pick), so the overrides compose against the same schema."""
    from moolib.conf import group_options

    picks = []
    for group in ("agent", "env", "scaling"):
        name = OmegaConf.select(saved, f"{group}.name")
        if group not in given and isinstance(name, str) and name in group_options(group):
            picks.append(f"{group}={name}")
    return picks


@dataclass
class Resume:
    """A run that continues the experiment of its savedir."""

    savedir: Path
    saved: DictConfig  # the config the savedir holds
    config: DictConfig  # saved + this command line's overrides
    overrides: list[str]  # as given (without savedir= and hydra settings)
    changes: list[tuple[str, Any, Any]] = field(default_factory=list)  # (key, old, new)
    # Settings added to moolib-run after the savedir was started: (key, default).
    added: list[tuple[str, Any]] = field(default_factory=list)
    step: int | None = None  # its checkpoint's step; None without a checkpoint
    # Set when checkpoint.pt is unusable: which files were passed over, which is used.
    fallback: str | None = None

    @property
    def finished(self) -> bool:
        """Its checkpoint already reached total_steps: nothing to train."""
        return self.step is not None and self.step >= int(self.config.total_steps)

    def describe(self) -> str:
        """One line for the terminal: what is resumed and what the overrides change
        (after a warning line when a damaged checkpoint was passed over)."""
        what = f"{self.saved.agent.name} on {self.saved.env.name}"
        where = (
            f"its checkpoint at step {self.step:,}" if self.step is not None else "no checkpoint"
        )
        changed = (
            "; overrides: "
            + ", ".join(f"{k}={_show(new)} (was {_show(old)})" for k, old, new in self.changes)
            if self.changes
            else "; no settings changed"
        )
        if self.added:
            changed += "; settings new since it started, at their defaults: " + ", ".join(
                f"{k}={_show(v)}" for k, v in self.added
            )
        line = f"moolib-run: resuming {self.savedir} ({what}, {where}){changed}"
        if self.fallback:
            # Never silent: a damaged checkpoint is named before the run goes on without it.
            line = f"moolib-run: warning: {self.fallback}\n{line}"
        return line

    def finished_message(self) -> str:
        """What a run of a finished savedir says (and how to go on)."""
        total = int(self.config.total_steps)
        more = max(2 * total, (self.step or 0) + total)
        return (
            f"moolib-run: {self.savedir} has finished: its checkpoint is at step {self.step:,}, "
            f"total_steps={total}; nothing to do. To train on, raise total_steps: "
            f"moolib-run savedir={self.savedir} total_steps={more}"
        )


def _show(value: Any) -> str:
    """A value as one would type it on the command line, on one line."""
    if isinstance(value, (dict, list, bool)) or value is None:
        return json.dumps(value, default=str)
    return repr(value) if isinstance(value, str) else str(value)


def merge(
    savedir: Path,
    saved: DictConfig,
    composed: DictConfig,
    overrides: list[Override],
) -> Resume:
    """``saved`` with ``overrides`` applied; values are taken from ``composed`` (the
    same overrides composed by Hydra against the saved groups). Raises ConfigError
    for an override that cannot apply to the experiment."""
    config = OmegaConf.create(OmegaConf.to_container(saved, resolve=True))
    added = _fill_missing(config, composed)
    OmegaConf.set_struct(config, True)
    changes: list[tuple[str, Any, Any]] = []
    given: list[str] = []
    # Group choices first, as Hydra applies them: a key of the group chosen
    # (scaling=local scaling.actors=3) is then a key of the config it is checked against.
    for ov in sorted(overrides, key=lambda o: not is_group_override(o)):
        if is_hydra_override(ov):
            continue
        key = ov.key_or_group
        if key not in NOT_SETTINGS:
            given.append(ov.input_line or f"{key}={ov.get_value_element_as_str()}")
        if is_group_override(ov):
            _apply_group(savedir, saved, composed, config, ov, changes)
            continue
        if ov.type == OverrideType.DEL:
            raise ConfigError(
                f"~{key}: settings cannot be deleted (every key is read); set a value instead"
            )
        # The config has the keys of the saved run, of a group switched to and of settings
        # new since. A +key adds itself to this command line's schema (and so to the
        # config): it is checked against the saved run's keys alone.
        known = saved if ov.type == OverrideType.ADD else config
        if not has_key(known, key) and not under_free_form(key):
            raise unknown_key_error(key, known_keys(known), f" in savedir {savedir}'s config")
        new = plain(OmegaConf.select(composed, key))
        old = plain(OmegaConf.select(config, key)) if has_key(config, key) else None
        if new != old or not has_key(config, key):
            with open_dict(config):
                OmegaConf.update(config, key, new, merge=False)
            if key not in NOT_SETTINGS:
                changes.append((key, old, new))
    # A group switched to another choice took that choice's settings whole: its keys
    # are not settings new since the savedir started.
    switched = {key for key, old, _ in changes if isinstance(old, dict)}
    added = [(key, value) for key, value in added if key.split(".", 1)[0] not in switched]
    for group in ("agent", "env"):
        # An Atari env's game is its name too (conf/env/atari.yaml: name follows game).
        game = "game" in saved[group] and config[group].get("game") != saved[group].game
        if config[group].name != saved[group].name or game:
            keys = (group, f"{group}.name", f"{group}.game")
            asked = [g for g in given if g.split("=")[0].lstrip("+~") in keys]
            raise ConfigError(
                f"savedir {savedir} holds {saved.agent.name} on {saved.env.name}; asked for "
                f"{' '.join(asked) or f'{group}={config[group].name}'}: a savedir resumes its own "
                "agent and env (give a new savedir for another)"
            )
    return Resume(Path(savedir), saved, config, given, changes, added)


def _fill_missing(
    config: DictConfig, schema: DictConfig, prefix: str = ""
) -> list[tuple[str, Any]]:
    """Adds the keys of ``schema`` that ``config`` lacks (settings that moolib-run
    gained after the savedir was started), at their defaults; returns them."""
    added = []
    for key in schema.keys():
        full = f"{prefix}{key}"
        if full == "hydra":
            continue
        if key not in config:
            value = plain(schema._get_node(key)._dereference_node())
            config[key] = value
            added.append((full, value))
        elif isinstance(schema[key], DictConfig) and isinstance(config[key], DictConfig):
            if full not in FREE_FORM:
                added += _fill_missing(config[key], schema[key], f"{full}.")
    return added


def _apply_group(
    savedir: Path,
    saved: DictConfig,
    composed: DictConfig,
    config: DictConfig,
    ov: Override,
    changes: list[tuple[str, Any, Any]],
) -> None:
    group = ov.key_or_group
    if group == "tuning":
        if ov.type == OverrideType.DEL:
            return  # no tuning file applies on resume anyway
        raise ConfigError(
            f"{ov.input_line}: a tuning file sets up a new run; savedir {savedir} keeps its "
            "settings (give the ones to change as key=value)"
        )
    if group not in composed or ov.type == OverrideType.DEL:
        raise ConfigError(f"{ov.input_line}: savedir {savedir} cannot drop its {group} settings")
    if group in ("agent", "env"):
        if composed[group].name != saved[group].name:
            raise ConfigError(
                f"savedir {savedir} holds {saved.agent.name} on {saved.env.name}; asked for "
                f"{ov.input_line}: a savedir resumes its own agent and env (give a new savedir "
                "for another)"
            )
        return  # the same choice changes nothing: the savedir's settings stay
    if composed[group].name != saved[group].name:
        new = plain(composed[group])
        changes.append((group, plain(saved[group]), new))
        with open_dict(config):
            config[group] = new


def checkpoint_state(savedir: Path) -> tuple[dict, str | None] | None:
    """The savedir's newest intact checkpoint (digest checked: ``checkpoint.pt``, else
    the newest intact one in ``checkpoints/``) and, when it is a fallback, one line
    saying which files were passed over and which is used. None without a
    checkpoint; ConfigError when none is intact, or when there is none but the logs
    went past step 0 (nothing is written then)."""
    from moolib.agents.runtime import checkpoint

    try:
        loaded = checkpoint.load_latest(Path(savedir))
    except checkpoint.CheckpointError as e:
        raise ConfigError(
            f"savedir={savedir}: {e}; restore one from a backup or give a new savedir"
        ) from e
    if loaded is None:
        steps = logged_steps(Path(savedir))
        if steps:
            # A run still training there may not have written its first checkpoint yet:
            # that the savedir is in use is the error then.
            savedir_lock.check_free(Path(savedir))
            # Resuming from step 0 would append a second run to the logs of the first.
            raise ConfigError(
                f"savedir={savedir} has no checkpoint ({CHECKPOINT_FILE} and checkpoints/ "
                f"are missing) for the {steps:,} steps its logs.tsv logged: to start over, "
                f"give a new savedir, or delete {savedir}"
            )
        return None
    note = checkpoint.describe_fallback(loaded) if loaded.skipped else None
    return loaded.state, note


def logged_steps(savedir: Path) -> int:
    """The furthest step the logs of the run in ``savedir`` reached (0 without logs)."""
    from . import report

    totals = report.read_totals(savedir)
    return totals.steps if totals is not None else 0


def check_model_fits(
    resume: Resume, agent: AgentConfig, state: dict, obs_shape: tuple[int, ...], num_actions: Any
) -> None:
    """Raises ConfigError when the model that ``agent`` (the resume's checked settings)
    builds cannot load the checkpoint (another network, width, LSTM, observation shape
    or number of actions)."""
    from moolib.agents.nets.models import resolve_network
    from moolib.agents.registry import get_agent

    model = get_agent(agent.name).make_network(agent, obs_shape, num_actions)
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    held = {k: tuple(v.shape) for k, v in state["model"].items()}
    if wanted == held:
        return
    diff = sorted(set(wanted) ^ set(held)) or [k for k in wanted if wanted[k] != held[k]]
    first = diff[0]
    detail = (
        f"{first}: {held.get(first, 'absent')} in the checkpoint, "
        f"{wanted.get(first, 'absent')} asked"
    )
    structural = [
        (k, old, new)
        for k, old, new in resume.changes
        if k.startswith(("agent.network", "agent.hidden_size", "agent.use_lstm", "env"))
    ]
    if structural:
        held_s = " ".join(f"{k}={_show(old)}" for k, old, _ in structural)
        asked_s = " ".join(f"{k}={_show(new)}" for k, _, new in structural)
    else:
        held_s = f"a model for {obs_shape} observations and other settings"
        asked_s = f"a {resolve_network(agent.network, obs_shape)} model with {num_actions} actions"
    raise ConfigError(
        f"savedir {resume.savedir} holds a checkpoint of {held_s}; asked for {asked_s}: "
        f"the model does not fit it ({detail})"
    )


def record(resume: Resume) -> Path:
    """Appends this resume (when, at which step, the overrides and what they changed)
    to ``<savedir>/resumes.yaml``."""
    path = resume.savedir / RESUMES_FILE
    entries = []
    if path.is_file():
        loaded = OmegaConf.to_container(OmegaConf.load(path))
        entries = list(loaded) if isinstance(loaded, list) else []
    entries.append(
        {
            "time": datetime.datetime.now().isoformat(timespec="seconds"),
            "step": resume.step,
            "overrides": list(resume.overrides),
            "changed": {k: {"from": old, "to": new} for k, old, new in resume.changes},
            **({"added": dict(resume.added)} if resume.added else {}),
        }
    )
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.create(entries)))
    tmp.replace(path)
    return path
