"""Rollout isolation, for training runs whose agents must reach nothing but their own rollout
(train.py; README "Sandboxes"). Each rollout is served under a route only it knows,
``/rollout/<id>.<token>/v1``; rewards are taken only with the harness's key (header X-Reward-Key),
which no agent sees; a sandboxed rollout reaches the proxy through a Unix socket of its own (its
sandbox's bridge, sandbox.py, connects 127.0.0.1:PORT inside to it), so whatever comes through it is
that rollout's doing: what the proxy refuses it is flagged on it.

Its hook, filled at the bottom: ``hooks.isolation = Isolation``. ``Proxy(rollout_tokens=True)``
keeps one as ``proxy.isolation``, which admits every request (``Proxy.read``), opens each rollout's
route and, for ``ProxyServer.endpoint(socket=True)``, its socket (:class:`RolloutSockets`)."""

import hmac
import itertools
import os
import secrets
import shutil
import tempfile
from typing import Optional

from aiohttp import web

from .. import hooks
from ..chat import BadRequest


class Isolation:
    """The routes of the rollouts opened this step, the harness's reward key, what each rollout was
    refused.

    >>> isolation = Isolation(); isolation.open_rollout("r1")   # 'r1.x1y2...': served at /rollout/r1.x1y2.../v1
    """

    def __init__(self):
        # rollout id -> its URL token
        self.tokens: dict[str, str] = {}
        # a reward POST's X-Reward-Key (Endpoint.reward_key: the harness's, never the agent's)
        self.reward_key = secrets.token_urlsafe(24)
        # a rollout's own Unix socket (RolloutSockets) -> its id
        self.owners: dict[str, str] = {}
        # rollout id -> what it tried that was refused (Proxy.flags)
        self.flags: dict[str, list[dict]] = {}
        # the rollouts' own Unix sockets, once one is asked for
        self.sockets: Optional[RolloutSockets] = None

    def open_rollout(self, rollout_id: str) -> str:
        """A new rollout's route, ``<id>.<token>``: its base URL is ``/rollout/<id>.<token>/v1``."""
        self.tokens[rollout_id] = secrets.token_urlsafe(16)
        return f"{rollout_id}.{self.tokens[rollout_id]}"

    def open_socket(self, server, rollout_id: str) -> str:
        """A Unix socket of the rollout's own on ``server`` (a ProxyServer): its path."""
        if self.sockets is None:
            self.sockets = RolloutSockets(server, self.owners)
        return self.sockets.open(rollout_id)

    def close_sockets(self, rollout_ids=None):
        """Close these rollouts' sockets; None: all of them, for good (ProxyServer.stop)."""
        if self.sockets is None:
            return
        if rollout_ids is None:
            self.sockets.close_all()
        else:
            self.sockets.close(rollout_ids)

    def reset(self):
        """The step is over: no rollout is open any more (a straggler's next call gets a 403)."""
        self.tokens, self.flags = {}, {}

    def admit(self, request: web.Request, rollout_id: str, reward: bool = False) -> str:
        """The rollout a request is for, or a 403. A call's route is ``<id>.<token>``, and a
        rollout's own socket carries only its calls; a reward (route ``<id>``) needs the reward key
        and an open rollout."""
        if reward:
            key = request.headers.get("X-Reward-Key", "").encode()
            if not hmac.compare_digest(key, self.reward_key.encode()):
                what = "rewards come from the harness (header X-Reward-Key), never from the agent"
                self.refuse(request, what)
            if rollout_id not in self.tokens:
                message = f"no rollout {rollout_id[:64]!r} in this run"
                raise BadRequest(message, None, "not_found", 404)
            return rollout_id
        rollout_id, _, token = rollout_id.rpartition(".")
        expected = self.tokens.get(rollout_id)
        if expected is None or not hmac.compare_digest(token.encode(), expected.encode()):
            self.refuse(request, "not a rollout of this run, or a wrong token")
        if (owner := self.owner(request)) not in (None, rollout_id):
            self.refuse(request, f"rollout {owner} used the route of rollout {rollout_id}")
        return rollout_id

    def owner(self, request: web.Request) -> Optional[str]:
        """The rollout whose own Unix socket the request came through, if any."""
        transport = request.transport
        return self.owners.get(transport.get_extra_info("sockname") if transport else None)

    def refuse(self, request: web.Request, what: str):
        """403, and a flag on the rollout that sent it, when its socket tells."""
        if owner := self.owner(request):
            attempt = f"{what}: {request.method} {request.path}"
            flag = {"kind": "route", "what": attempt, "call": None, "where": None, "match": None}
            self.flags.setdefault(owner, []).append(flag)
        raise BadRequest(f"{what}: use the base URL this rollout was given", None, "forbidden", 403)


class RolloutSockets:
    """The Unix sites of one ``ProxyServer``, one a rollout, in a temporary directory of their own.

    >>> sockets = RolloutSockets(server, owners); sockets.open("r1")   # '/tmp/ll-proxy-x1y2/0.sock'
    >>> sockets.close(["r1"])
    """

    def __init__(self, server, owners: dict[str, str]):
        self.server = server
        # rollout id -> (its site, its path)
        self.sites = {}
        # socket path -> rollout id, for Isolation.owner
        self.owners = owners
        # short paths: a socket path has at most 107 bytes
        self.dir = tempfile.mkdtemp(prefix="ll-proxy-")
        self.names = itertools.count()

    def open(self, rollout_id: str) -> str:
        path = os.path.join(self.dir, f"{next(self.names)}.sock")
        site = web.UnixSite(self.server.runner, path)
        self.server.run(site.start())
        self.sites[rollout_id] = (site, path)
        self.owners[path] = rollout_id
        return path

    def close(self, rollout_ids):
        for rollout_id in rollout_ids:
            if rollout_id in self.sites:
                site, path = self.sites.pop(rollout_id)
                self.server.run(site.stop())
                del self.owners[path]
                os.unlink(path)

    def close_all(self):
        self.close(list(self.sites))
        shutil.rmtree(self.dir, ignore_errors=True)


hooks.isolation = Isolation
