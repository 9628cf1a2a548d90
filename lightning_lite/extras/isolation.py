"""Rollout isolation, for training runs whose agents must reach nothing but their own rollout
(train.py; docs/sandboxes.md). Each rollout is served under a route only it knows,
``/rollout/<id>.<token>/v1``; rewards are taken only with the harness's key (header X-Reward-Key),
which no agent sees; a sandboxed rollout reaches the proxy through a Unix socket of its own (its
sandbox's bridge, sandbox.py, connects 127.0.0.1:PORT inside to it), so whatever comes through it is
that rollout's doing: what the proxy refuses it is flagged on it.

Its hook, filled at the bottom: ``hooks.isolation = Isolation``. ``Proxy(rollout_tokens=True)``
keeps one as ``proxy.isolation``, which admits every request (``Proxy.read``) and gives each rollout
its endpoint (``ProxyServer.endpoint``): its route and, with ``socket=True``, its socket."""

import hmac
import itertools
import os
import secrets
import shutil
import tempfile
from dataclasses import replace
from typing import Optional

from aiohttp import web

from .. import hooks
from ..chat import BadRequest
from ..harness import Endpoint


class Isolation:
    """The routes of the rollouts opened this step, the harness's reward key, what each rollout was
    refused, and the rollouts' own Unix sockets (sites of the ProxyServer, in a temporary directory
    of their own).

    >>> server = ProxyServer(Proxy(backend, tok, rollout_tokens=True)).start()
    >>> server.endpoint("r1", "m", socket=True).base_url
    'http://127.0.0.1:40123/rollout/r1.x1y2.../v1'   # and .socket: '/tmp/ll-proxy-x1y2/0.sock'
    """

    def __init__(self):
        # rollout id -> its URL token
        self.tokens: dict[str, str] = {}
        # a reward POST's X-Reward-Key (Endpoint.reward_key: the harness's, never the agent's)
        self.reward_key = secrets.token_urlsafe(24)
        # rollout id -> what it tried that was refused (Proxy.flags)
        self.flags: dict[str, list[dict]] = {}
        # rollout id -> (its site, its socket path); socket path -> rollout id
        self.sites: dict[str, tuple] = {}
        self.owners: dict[str, str] = {}
        # the ProxyServer the sites are on, and their directory (short paths: a socket path has at
        # most 107 bytes), once the first socket is asked for
        self.server = None
        self.dir: Optional[str] = None
        self.names = itertools.count()

    def endpoint(self, server, plain: Endpoint, socket: bool) -> Endpoint:
        """A new rollout's endpoint on ``server`` (a ProxyServer): ``plain`` (on the route of its
        bare id) moved to its route ``<id>.<token>``, with the reward key, and with ``socket`` a
        Unix socket of its own."""
        rollout_id = plain.rollout_id
        self.tokens[rollout_id] = secrets.token_urlsafe(16)
        route = f"{rollout_id}.{self.tokens[rollout_id]}"
        socket_path = None
        if socket:
            socket_path = self.open_socket(server, rollout_id)
        url = server.base_url(route)
        key = self.reward_key
        return replace(plain, base_url=url, route=route, reward_key=key, socket=socket_path)

    def open_socket(self, server, rollout_id: str) -> str:
        """A Unix socket of the rollout's own on ``server``: its path."""
        if self.dir is None:
            self.server = server
            self.dir = tempfile.mkdtemp(prefix="ll-proxy-")
        path = os.path.join(self.dir, f"{next(self.names)}.sock")
        site = web.UnixSite(server.runner, path)
        server.run(site.start())
        self.sites[rollout_id] = (site, path)
        self.owners[path] = rollout_id
        return path

    def close_sockets(self, rollout_ids=None):
        """Close these rollouts' sockets; None: all of them and their directory, for good
        (ProxyServer.stop)."""
        closing = rollout_ids
        if rollout_ids is None:
            closing = list(self.sites)
        for rollout_id in closing:
            if rollout_id in self.sites:
                site, path = self.sites.pop(rollout_id)
                self.server.run(site.stop())
                del self.owners[path]
                os.unlink(path)
        if rollout_ids is None and self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def reset(self):
        """The step is over: no rollout is open any more (a straggler's next call gets a 403)."""
        self.tokens = {}
        self.flags = {}

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
        owner = self.owner(request)
        if owner not in (None, rollout_id):
            self.refuse(request, f"rollout {owner} used the route of rollout {rollout_id}")
        return rollout_id

    def owner(self, request: web.Request) -> Optional[str]:
        """The rollout whose own Unix socket the request came through, if any."""
        transport = request.transport
        return self.owners.get(transport.get_extra_info("sockname") if transport else None)

    def refuse(self, request: web.Request, what: str):
        """403, and a flag on the rollout that sent it, when its socket tells."""
        owner = self.owner(request)
        if owner:
            attempt = f"{what}: {request.method} {request.path}"
            flag = {"kind": "route", "what": attempt, "call": None, "where": None, "match": None}
            self.flags.setdefault(owner, []).append(flag)
        raise BadRequest(f"{what}: use the base URL this rollout was given", None, "forbidden", 403)


hooks.isolation = Isolation
