"""The routing-policy interface: what a routing policy sees (a request and a view of the
cluster) and what it returns (an instance, optionally with a KV migration).

A routing policy is one subclass of :class:`RoutingPolicy` with a ``name`` and a
``route`` method; defining the class registers it, and :func:`get_policy` builds it by
name. The same objects drive the discrete-event simulator, the toy engine's router in
``benchmarks/toy_engine`` and a router over real engines (its views built from the
nodes' KV summaries by :func:`cluster_view`), so a routing policy never touches engines
or the store itself: everything it may use is in the :class:`ClusterView` it is handed.

Example, a routing policy that sends each session to a fixed instance::

    class Sticky(RoutingPolicy):
        name = "sticky"

        def route(self, request: Request, view: ClusterView) -> Decision:
            return Decision(hash(request.session) % len(view.instances))

    get_policy("sticky")
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

from tensordb.errors import InvalidInput, NotFound

__all__ = [
    "SHARED_PREFIX",
    "ClusterView",
    "Decision",
    "InstanceState",
    "Request",
    "RoutingPolicy",
    "available_policies",
    "get_policy",
]

#: the chain id of the blocks every session shares (the system prompt)
SHARED_PREFIX = "<shared>"

Chain = tuple[tuple[Hashable, int], ...]


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a session: a prompt of ``input_tokens`` of which the first
    ``shared_prefix_tokens`` (the system prompt) are the same for every session, and the
    rest extends the previous turn's prompt and output (append-only context).

    ``context`` numbers the session's contexts: a trace whose prompt shrinks (the agent
    compacted its history) starts a new one, whose blocks share nothing with the old.
    ``block_keys`` may carry the engine's own keys (chained hashes of token ids); the
    simulator ignores them and uses :meth:`chain`, which describes the same blocks.
    """

    session: Hashable
    arrival: float
    input_tokens: int
    output_tokens: int = 1
    turn: int = 0
    shared_prefix_tokens: int = 0
    context: int = 0
    block_keys: tuple[Hashable, ...] | None = None

    def __post_init__(self) -> None:
        if self.input_tokens < 1 or self.output_tokens < 0:
            raise InvalidInput(f"request of session {self.session!r}: input_tokens must be "
                               f">= 1 and output_tokens >= 0, got {self.input_tokens}, "
                               f"{self.output_tokens}")
        if not 0 <= self.shared_prefix_tokens <= self.input_tokens:
            raise InvalidInput(f"request of session {self.session!r}: shared_prefix_tokens "
                               f"{self.shared_prefix_tokens} outside [0, input_tokens]")

    def chain(self, block_tokens: int, tokens: int | None = None) -> Chain:
        """The full blocks of the first ``tokens`` (default: the prompt) as segments
        ``(chain id, count)``: the shared system-prompt blocks, then the session's own.
        Block ``i`` of a segment is the same KV wherever the segment appears, which is
        what makes a prefix a prefix. A block straddling the end of the system prompt
        belongs to the session."""
        n = (self.input_tokens if tokens is None else tokens) // block_tokens
        shared = min(n, self.shared_prefix_tokens // block_tokens)
        own = n - shared
        segs: list[tuple[Hashable, int]] = []
        if shared:
            segs.append((SHARED_PREFIX, shared))
        if own:
            segs.append(((self.session, self.context), own))
        return tuple(segs)

    def keys(self, block_tokens: int) -> list[Hashable]:
        """One key per full block of the prompt (``block_keys`` when given)."""
        if self.block_keys is not None:
            return list(self.block_keys)
        out: list[Hashable] = []
        for cid, count in self.chain(block_tokens):
            out.extend((cid, i) for i in range(count))
        return out


@dataclass(frozen=True, slots=True)
class InstanceState:
    """What the router knows of one instance when a request arrives.

    ``prefix_hits``: tokens of this request's prompt prefix whose KV the instance holds
    (full blocks only). ``queued_tokens``: prompt tokens still to prefill in its queue;
    ``running_tokens``: context tokens of the requests it is decoding. ``load_ewma``: an
    exponentially weighted moving average of ``queued + running``. ``last_seen``: when
    the instance last served this request's session (None: never).
    """

    instance: int
    prefix_hits: int = 0
    queued_tokens: int = 0
    running_tokens: int = 0
    load_ewma: float = 0.0
    last_seen: float | None = None

    @property
    def load(self) -> int:
        return self.queued_tokens + self.running_tokens


@dataclass(frozen=True, slots=True)
class ClusterView:
    """The instances (indexed by their ``instance`` id, 0..n-1) at ``time`` seconds."""

    instances: tuple[InstanceState, ...]
    time: float = 0.0
    block_tokens: int = 256

    def __post_init__(self) -> None:
        if not self.instances:
            raise InvalidInput("a cluster view needs at least one instance")
        for i, inst in enumerate(self.instances):
            if inst.instance != i:
                raise InvalidInput(f"instance {i} of the view has id {inst.instance}")

    def least_loaded(self, key: str = "load") -> InstanceState:
        """The instance with the least ``load`` (or ``load_ewma``); ties: lowest id."""
        return min(self.instances, key=lambda s: getattr(s, key))

    def best_prefix(self) -> InstanceState:
        """The instance holding the longest prefix; ties: the least loaded, then lowest id."""
        return max(self.instances, key=lambda s: (s.prefix_hits, -s.load))


@dataclass(frozen=True, slots=True)
class Decision:
    """Route to ``instance``; if ``migrate_from`` is set, first move the request's KV
    blocks that instance holds (and ``instance`` lacks) to ``instance``: at most
    ``blocks`` of them, all when 0."""

    instance: int
    migrate_from: int | None = None
    blocks: int = 0

    def __post_init__(self) -> None:
        if self.migrate_from is not None and self.migrate_from == self.instance:
            raise InvalidInput(f"a migration to instance {self.instance} from itself")
        if self.blocks < 0:
            raise InvalidInput(f"blocks must be >= 0, got {self.blocks}")


_REGISTRY: dict[str, type[RoutingPolicy]] = {}


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class RoutingPolicy(ABC):
    """A routing policy. Subclasses join the registry under ``name`` (default: the class
    name in snake case) when they are defined; abstract ones do not.

    ``route`` is called once per request, in arrival order, from one thread; it may keep
    state on ``self`` (``reset`` clears it between runs) and must not block.
    """

    name: ClassVar[str] = ""

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "name" not in cls.__dict__:
            cls.name = _snake(cls.__name__)
        if getattr(cls.route, "__isabstractmethod__", False):
            return
        old = _REGISTRY.get(cls.name)
        if old is not None and (old.__module__, old.__qualname__) != (
                cls.__module__, cls.__qualname__):
            raise InvalidInput(f"routing policy name {cls.name!r} is taken by "
                               f"{old.__module__}.{old.__qualname__}")
        _REGISTRY[cls.name] = cls  # the same class defined again (a reload) replaces it

    @abstractmethod
    def route(self, request: Request, view: ClusterView) -> Decision:
        """Where ``request`` goes, given ``view``."""

    def reset(self) -> None:  # noqa: B027 (a no-op default: stateless policies keep it)
        """Forget any state kept between requests (a new run starts)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


def available_policies() -> list[str]:
    """The names of the registered routing policies, sorted."""
    return sorted(_REGISTRY)


def get_policy(name: str | RoutingPolicy, **kw: Any) -> RoutingPolicy:
    """A new instance of the routing policy registered as ``name``, built with ``kw``
    (a routing policy object is returned as is)."""
    if isinstance(name, RoutingPolicy):
        return name
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise NotFound(f"no routing policy named {name!r}; known: "
                       f"{', '.join(available_policies())}") from None
    return cls(**kw)
