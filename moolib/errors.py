"""The errors of moolib: one class per kind of failure.

The errors of calls and collectives derive from :class:`RpcError` (itself a
``RuntimeError``, as in the original moolib), so ``except moolib.RpcError``
still catches them all; catch a subclass to handle one kind of failure. The
core reports each failure as a code (moolib/core/runtime/error.h) and the binding
raises the class registered for that code here; the message is for people,
and nothing in moolib decides by it. The errors of a ``ReplayClient``
(:class:`ReplayError`, and its subclasses that are also a ``TimeoutError`` or
a ``ConnectionError``) and of an ``Accumulator`` whose peers hold other models
(:class:`ModelMismatchError`) are ``RuntimeError``s of their own.
docs/errors.md says what to do about each.
"""

from __future__ import annotations

import concurrent.futures

from . import _core

__all__ = [
    "AuthenticationError",
    "ConnectionLostError",
    "FunctionNotDefinedError",
    "MembershipChangedError",
    "ModelMismatchError",
    "RemoteError",
    "ReplayError",
    "ReplayTimeoutError",
    "RpcCancelledError",
    "RpcError",
    "RpcTimeoutError",
    "ShardTimeoutError",
    "ShardUnavailableError",
    "SharedMemoryUnavailableError",
]

RpcError = _core.RpcError


class RpcTimeoutError(RpcError, TimeoutError):
    """No reply came within the call's timeout (``Rpc.set_timeout``): the peer
    is slow or stuck, or was never found or linked to (the message says which).
    Also an all-reduce that did not complete within the group's collective
    timeout, on every member; its message names the members it waited for.

    Not raised by ``Future.result(timeout=...)`` giving up its own wait: that
    is a plain ``TimeoutError``, and the call goes on."""


class ConnectionLostError(RpcError, ConnectionError):
    """Every link to the peer closed while the call waited for its reply: the
    peer's process exited or was killed, it closed its Rpc, or the network
    dropped the connection. The call may or may not have run there. Also every
    call still waiting when this Rpc is closed."""


class FunctionNotDefinedError(RpcError):
    """The peer was reached but has no function of that name (not defined yet,
    undefined, or a typo)."""


class RemoteError(RpcError):
    """The function ran on the peer and raised. The message holds the remote
    exception's type, message and traceback; the peer is there and serving."""


class RpcCancelledError(RpcError, concurrent.futures.CancelledError):
    """The call or all-reduce was given up with ``cancel()`` before it
    completed; its result is never delivered."""


class SharedMemoryUnavailableError(RpcError):
    """An all-reduce among members on one host could not create or map the
    shared memory it goes through (another user, a sandbox, /dev/shm full).
    The member stops offering shared memory, so the group's next membership
    reduces over sockets: call ``update()`` and run the all-reduce again."""


class MembershipChangedError(RpcError):
    """An all-reduce failed because the group's membership changed while it
    ran, or this peer was not, or is no longer, an active member (it lost the
    broker, left for not calling ``update()``, or closed the group). Call
    ``update()`` until ``active()`` and run it again under the new
    membership."""


class AuthenticationError(RpcError):
    """The peer was not reached, and links this Rpc dialed meanwhile were
    refused at authentication: the keys differ, or only one side has one
    (``MOOLIB_AUTH_KEY``, ``moolib.set_auth_key``). Raised once the call's
    timeout has passed, as the timeout it replaces."""


class ModelMismatchError(RuntimeError):
    """Peers of one group hold models of different layouts (see Accumulator.update)."""


class ReplayError(RuntimeError):
    """A ``ReplayClient`` call failed; names the peer. Raised itself where a
    shard refused the call (a NaN priority, an item of another layout: the
    shard stays in use); the subclasses say when it timed out or a shard is
    down. The error it comes from, if any (the call's ``RemoteError``,
    ``RpcTimeoutError``, ...), is its ``__cause__``."""


class ReplayTimeoutError(ReplayError, TimeoutError):
    """A replay call gave up waiting: the tables' rate limiting (``min_size``,
    ``samples_per_insert``) held an insert or a sample past the client's
    ``timeout`` (the message says how far it got; the items inserted so far
    stay), or, as ``ShardTimeoutError``, a shard did not reply within the
    Rpc's timeout."""


class ShardUnavailableError(ReplayError, ConnectionError):
    """A shard did not answer (its connection was lost, it is not linked, it
    timed out): raised for a call in flight to it when it went (an insert then
    may or may not be in its table), and for a call that no live shard can
    serve. A shard that is down is left out until it answers again."""


class ShardTimeoutError(ShardUnavailableError, ReplayTimeoutError):
    """A shard did not reply within the Rpc's timeout (``Rpc.set_timeout``):
    it is down, and left out as any unavailable shard, until it answers
    again. Its ``__cause__`` is the call's ``RpcTimeoutError``."""


# The names are the core's (moolib/core/runtime/error.h, errorCodeName); a failure
# of a code not listed (a malformed message, members that disagree) is a
# plain RpcError.
_core._set_error_classes(
    {
        "timeout": RpcTimeoutError,
        "connection_lost": ConnectionLostError,
        "not_defined": FunctionNotDefinedError,
        "remote_exception": RemoteError,
        "cancelled": RpcCancelledError,
        "shared_memory_unavailable": SharedMemoryUnavailableError,
        "membership_changed": MembershipChangedError,
        "authentication_failed": AuthenticationError,
    }
)
