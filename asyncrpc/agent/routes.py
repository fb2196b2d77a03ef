"""Which transport reaches each peer, and why: the agent's dial plan (sans-IO).

Theory of operation
-------------------
A worker publishes an address per scheme it listens on (``WorkerAddress.addresses``)
and its host (``WorkerAddress.host``, a :class:`~asyncrpc.transport.Host` in text).
A peer is dialed on the schemes of our ``transports`` option, in that order, that it
offers, skipping a scheme whose scope (see ``transport.endpoints.Scheme``) our hosts
do not share: unix sockets only within one network namespace.  The plan ends at the
first scheme without a scope (tcp): past it there is nothing to fall back on.

That two hosts share a scope is proven by their identities, as far as they go; a
dial that finds nobody at a scoped address (``PeerLostError(unreachable=True)``)
proves them wrong, so the agent tries the next route at once, and ``refused``
remembers the failure: that peer is never dialed on that scheme again.  ``chosen``
records the route a link was made on, and ``why`` says which and why (the debug info).

Contact lost: once a link with a peer is lost or a dial to it fails (``lost``), the
agent bounds the connect of each dial to that peer by ``redial_timeout`` instead of
``connect_timeout`` (``lost_contact`` says since what), until a dial succeeds
(``chosen``).  One rule makes calls fail fast during a partition (a connect into a
silent network would wait for the whole ``connect_timeout``) and lets the first call
after it heal: every call dials afresh.  Only the connect is bounded, which the peer's
kernel answers however busy its process is; the handshake keeps its own bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrpc.agent.worker import WorkerAddress
from asyncrpc.errors import PeerLostError
from asyncrpc.transport import SCHEMES, Host


@dataclass(frozen=True, slots=True)
class Route:
    """Dial ``address`` (of ``scheme``); ``why``: why this one, in words."""

    scheme: str
    address: str
    why: str


class Routes:
    """Dial plans to the peers of one worker on ``here``, and what each link used."""

    def __init__(self, transports: tuple[str, ...], here: Host) -> None:
        self.transports = transports
        self.here = here
        self._refused: dict[tuple[str, str], str] = {}  # (peer, scheme) -> why
        self._chosen: dict[str, Route] = {}
        self._lost: dict[str, str] = {}  # peer -> why contact with it was lost

    def plan(self, target: WorkerAddress) -> list[Route]:
        """The routes to try, in order (each but the last has a scope); raises
        ``PeerLostError`` if there is none."""
        theirs = Host.parse(target.host)
        routes: list[Route] = []
        skipped: list[str] = []
        for scheme in self.transports:
            why_not = self._why_not(target, scheme, theirs)
            if why_not is not None:
                skipped.append(why_not)
                continue
            routes.append(Route(scheme, target.addresses[scheme], self._why(scheme, skipped)))
            if SCHEMES[scheme].scope is None:
                break
        if not routes:
            raise PeerLostError(
                f"no common transport with worker {target.name!r} ({'; '.join(skipped)})",
                worker=target.name,
                sent=False,
            )
        return routes

    def refused(self, peer: str, route: Route, exc: BaseException) -> None:
        """Nobody answered ``route``: never dial ``peer`` there again."""
        self._refused[peer, route.scheme] = f"{route.scheme} dial failed: {_cause(exc)}"

    def chosen(self, peer: str, route: Route) -> None:
        """A link to ``peer`` was made on ``route``: contact with it is back, if it was lost."""
        self._chosen[peer] = route
        self._lost.pop(peer, None)

    def lost(self, peer: str, why: str) -> None:
        """Our link with ``peer`` was lost, or a dial to it failed (``why``); the first
        loss is kept until contact is back."""
        self._lost.setdefault(peer, why)

    def lost_contact(self, peer: str) -> str | None:
        """Why contact with ``peer`` was lost, if it is; None while it is not."""
        return self._lost.get(peer)

    def why(self, peer: str) -> dict[str, str]:
        """The transport of our link to ``peer`` and why it was chosen (empty before)."""
        route = self._chosen.get(peer)
        return {} if route is None else {"transport": route.scheme, "why": route.why}

    def _why_not(self, target: WorkerAddress, scheme: str, theirs: Host) -> str | None:
        """Why ``scheme`` is no route to ``target``; None if it is one."""
        refused = self._refused.get((target.name, scheme))
        if refused is not None:
            return refused
        if scheme not in target.addresses:
            return f"{target.name!r} offers no {scheme}"
        scope = SCHEMES[scheme].scope
        return None if scope is None else self.here.refusal(theirs, scope)

    def _why(self, scheme: str, skipped: list[str]) -> str:
        """Why ``scheme`` is tried: the schemes preferred to it were not routes."""
        if skipped:
            return "; ".join(skipped)
        scope = SCHEMES[scheme].scope
        if scope is None:
            return f"first of transports {list(self.transports)}"
        return f"same {scope.name}"


def _cause(exc: BaseException) -> str:
    """What the dial's error says of its cause (the OSError behind it, as a rule)."""
    cause = exc.__cause__
    return str(cause) if cause is not None else str(exc)
