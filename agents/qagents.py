"""Ape-X and R2D2 registered as agents: each spec joins its settings, loss, network
and acting (``moolib.agents.qlearning``) to the runtime that trains them
(``moolib.agents.runtime.offpolicy``). A module of its own because that runtime builds
on ``qlearning``: registering there would make the two import each other."""

from __future__ import annotations

from .qlearning import (
    ApexActing,
    ApexConfig,
    R2D2Acting,
    R2D2Config,
    apex_loss,
    make_dueling_qnet,
    make_recurrent_qnet,
    r2d2_loss,
)
from .registry import register_agent
from .runtime.offpolicy import OffPolicyRuntime

register_agent(
    "apex",
    ApexConfig,
    make_network=make_dueling_qnet,
    acting=ApexActing,
    runtime=OffPolicyRuntime,
)(apex_loss)
register_agent(
    "r2d2",
    R2D2Config,
    make_network=make_recurrent_qnet,
    acting=R2D2Acting,
    runtime=OffPolicyRuntime,
)(r2d2_loss)
