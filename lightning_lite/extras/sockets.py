"""Per-rollout Unix sockets, for sandboxed rollouts (README "Sandboxes"): a sandbox's bridge (sandbox.py)
connects 127.0.0.1:PORT inside it to a socket of the proxy that only its rollout uses, so whatever comes through
it is that rollout's doing: a request on another rollout's route is refused and flagged on the sender
(``Proxy.rollout``). Its hooks: ``ProxyServer.endpoint(socket=True)`` opens one through :class:`RolloutSockets`,
and the proxy reads who sent a request from ``proxy.sockets`` (socket path -> rollout id)."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile

from aiohttp import web


class RolloutSockets:
    """The Unix sites of one ``ProxyServer``, one a rollout, in a temporary directory of their own.

    >>> sockets = RolloutSockets(server); sockets.open("r1")   # '/tmp/ll-proxy-x1y2/0.sock'
    >>> sockets.close(["r1"])
    """

    def __init__(self, server):
        self.server, self.sites = server, {}
        # short paths: a socket path has at most 107 bytes
        self.dir, self.names = tempfile.mkdtemp(prefix="ll-proxy-"), itertools.count()

    def open(self, rollout_id: str) -> str:
        path = os.path.join(self.dir, f"{next(self.names)}.sock")
        site = web.UnixSite(self.server.runner, path)
        self.server.run(site.start())
        self.sites[rollout_id], self.server.proxy.sockets[path] = (site, path), rollout_id
        return path

    def close(self, rollout_ids):
        for rollout_id in rollout_ids:
            if rollout_id in self.sites:
                site, path = self.sites.pop(rollout_id)
                self.server.run(site.stop())
                del self.server.proxy.sockets[path]
                os.unlink(path)

    def close_all(self):
        self.close(list(self.sites))
        shutil.rmtree(self.dir, ignore_errors=True)
