"""The web console: a read-only view of one store in a browser.

    from tensordb.console import serve_console
    console = serve_console(db, port=0, auth=authenticator)   # console.url, console.close()

``tensordb serve --console-port P`` serves it beside a node server, behind the node's
token and the catalog's scoped tokens; ``tensordb console --home DIR`` serves it for an
embedded store. Pages: collections and their history (bytes written against bytes
shared), the tensors of a version, tiers per node, KV namespaces with hit rate and
occupancy over time, nodes and replication, policies and their last runs, and a query
box for read statements (docs/operations.md, "Console").

This layer sits above the client (``tensordb.client``) and reads through its public
face and the query language only.
"""

from __future__ import annotations

from ._app import SESSION_COOKIE, make_app
from ._data import READ_STATEMENTS
from ._series import KVSeries, Sample
from ._server import ConsoleServer, serve_console

__all__ = ["READ_STATEMENTS", "SESSION_COOKIE", "ConsoleServer", "KVSeries", "Sample",
           "make_app", "serve_console"]
