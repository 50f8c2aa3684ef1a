"""What each console page shows, read from one store and cut to one token's scope.

Every page reads through the store's public faces only: statements of the query
language (``SELECT`` over its virtual tables, the same rows ``tensordb query`` prints),
``Database.kv_counters`` for the KV namespaces' shared counters, and
``Database.holdings`` for what each node holds of a collection's head. Nothing here
writes: no lease is taken, no namespace is opened for writing, no row is added.

A token (a ``Grant``) sees the collections and KV namespaces its scope covers. The
node-wide figures (tiers, nodes, policies, the query box) name or sum every tenant's
data, so they are shown only to a token whose scope is every name (``*``); a narrower
token is told why they are missing. ``grant=None`` is a console without tokens (on
loopback, beside a node that has none): it sees everything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import query
from tensordb.catalog import Grant
from tensordb.errors import CorruptData, InvalidInput, NotFound

if TYPE_CHECKING:
    from tensordb.client import Database

__all__ = ["PAGE_ROWS", "QUERY_ROWS", "READ_STATEMENTS", "Page", "collection_page",
           "collections_page", "kv_page", "nodes_page", "policies_page", "query_page",
           "sees_all", "tiers_page", "version_page", "visible"]

#: tensors listed per page of a version
PAGE_ROWS = 500
#: rows of a query box result shown (the statement's own LIMIT can ask for fewer)
QUERY_ROWS = 1000
#: the statements the query box runs: they read, and change nothing
READ_STATEMENTS = ("SELECT", "EXPLAIN", "SHOW POLICIES")


def sees_all(grant: Grant | None) -> bool:
    """Whether a token may see node-wide figures: every name is in its scope."""
    return grant is None or grant.scope == "*"


def visible(grant: Grant | None, name: str) -> bool:
    """Whether a collection or KV namespace is in the token's scope."""
    return grant is None or grant.covers(name)


@dataclass
class Page:
    """What a page renders: its values, and why a part of it is withheld (None: it
    is not)."""

    values: dict[str, Any]
    withheld: str | None = None


def _rows(db: Database, text: str, params: Mapping[str, object] | None = None
          ) -> list[dict[str, Any]]:
    return db.query(text, params).to_pylist()


def _withheld(grant: Grant | None, what: str) -> str | None:
    if sees_all(grant):
        return None
    assert grant is not None
    return (f"{what} cover every tenant's data: they need a token whose scope is '*' "
            f"(this one's is {grant.scope!r})")


def collections_page(db: Database, grant: Grant | None) -> Page:
    """Every visible collection: head, tensors, bytes of the head, versions, tags; the
    bytes its segments store (what quotas count: a shared extent once, a segment whole
    until gc frees it) against the bytes its retained versions hold, and what sharing
    saved between the two."""
    cols = [r for r in _rows(db, "SELECT name, head, tensors, nbytes, versions, created_at "
                                 "FROM collections ORDER BY name") if visible(grant, r["name"])]
    logical = {r["collection"]: r["logical"] for r in _rows(
        db, "SELECT collection, sum(nbytes) AS logical FROM commits GROUP BY collection")}
    stored = {r["collection"]: r["stored"] for r in _rows(
        db, "SELECT collection, sum(nbytes) AS stored FROM extents GROUP BY collection")}
    tags: dict[str, list[str]] = {}
    for r in _rows(db, "SELECT collection, tag, version FROM tags ORDER BY tag"):
        tags.setdefault(r["collection"], []).append(f"{r['tag']}@{r['version']}")
    for c in cols:
        c["stored"] = int(stored.get(c["name"]) or 0)
        c["logical"] = int(logical.get(c["name"]) or 0)
        c["saved"] = max(0, c["logical"] - c["stored"])
        c["tags"] = tags.get(c["name"], [])
    return Page({"collections": cols})


def _check_visible(grant: Grant | None, name: str, kind: str = "collection") -> None:
    if not visible(grant, name):  # the same answer as a name that does not exist
        raise NotFound(f"no {kind} {name!r}", collection=name)


def collection_page(db: Database, grant: Grant | None, name: str) -> Page:
    """One collection's history, newest first: each version's message, tensors, bytes,
    bytes written and shared with the versions before it, tags; and what each node
    holds of the head."""
    _check_visible(grant, name)
    versions = _rows(db, "SELECT version, parent, message, created_at, tensors, nbytes, "
                         "written, written_nbytes FROM commits WHERE collection = :c "
                         "ORDER BY version DESC", {"c": name})
    if not versions and name not in db.collections():
        raise NotFound(f"no collection {name!r}", collection=name)
    tags: dict[int, list[str]] = {}
    for r in _rows(db, "SELECT tag, version FROM tags WHERE collection = :c ORDER BY tag",
                   {"c": name}):
        tags.setdefault(r["version"], []).append(r["tag"])
    for v in versions:
        v["shared_nbytes"] = max(0, v["nbytes"] - v["written_nbytes"])
        v["tags"] = tags.get(v["version"], [])
    return Page({"name": name, "versions": versions})


def version_page(db: Database, grant: Grant | None, name: str, version: int,
                 offset: int = 0) -> Page:
    """The tensors of one version (PAGE_ROWS from ``offset``, by name): dtype, shape,
    bytes, checksum, and where its bytes lie (tier, node)."""
    _check_visible(grant, name)
    if offset < 0:
        raise InvalidInput(f"offset must be >= 0, not {offset}")
    where = ("collection = :c AND first_version <= :v AND "
             "(end_version IS NULL OR end_version > :v)")
    params = {"c": name, "v": version}
    head = _rows(db, "SELECT version, tensors, nbytes, message, created_at FROM commits "
                     "WHERE collection = :c AND version = :v", params)
    if not head:
        raise NotFound(f"{name!r} has no version {version}", collection=name)
    if offset and offset >= head[0]["tensors"]:
        raise NotFound(f"{name!r} v{version} has {head[0]['tensors']} tensors: none from "
                       f"{offset} on", collection=name)
    rows = _rows(db, f"SELECT name, dtype, shape, nbytes, checksum, tier, node "
                     f"FROM versions WHERE {where} ORDER BY name LIMIT {PAGE_ROWS} "
                     f"OFFSET {int(offset)}", params)
    return Page({"name": name, "version": head[0], "tensors": rows, "offset": offset,
                 "page_rows": PAGE_ROWS})


def tiers_page(db: Database, grant: Grant | None) -> Page:
    """Bytes and extents per node and tier, this host's tiers and pools, the tenants'
    quotas and what each stores (node-wide); and each visible collection's head bytes
    per node and tier."""
    per_collection = [r for r in _rows(
        db, "SELECT collection, node, tier, count(*) AS tensors, sum(nbytes) AS nbytes "
            "FROM tensors GROUP BY collection, node, tier ORDER BY collection, node, tier")
        if visible(grant, r["collection"])]
    values: dict[str, Any] = {"per_collection": per_collection, "node": db.config.node}
    withheld = _withheld(grant, "the tiers of each node")
    if withheld is None:
        values["extents"] = _rows(
            db, "SELECT node, tier, count(*) AS extents, sum(nbytes) AS nbytes FROM extents "
                "GROUP BY node, tier ORDER BY node, tier")
        st = db.stats()
        values["local"] = [{"tier": t, "nbytes": st[f"{t}_bytes"],
                            "pool": st[f"{t}_pool_bytes"]} for t in ("host", "disk")]
        values["quotas"] = db.quotas()
    return Page(values, withheld)


def kv_page(db: Database, grant: Grant | None) -> Page:
    """The KV namespaces of this node in the token's scope, with their shared counters
    now (hits, misses, hit rate, blocks and bytes per medium, occupancy)."""
    out = []
    for r in _rows(db, "SELECT name, block_tokens, node, created_at FROM kv_namespaces "
                       "WHERE node = :n ORDER BY name", {"n": db.config.node}):
        if not visible(grant, r["name"]):
            continue
        try:
            got = db.kv_counters(r["name"])
        except CorruptData as exc:  # shown damaged; the other namespaces still shown
            r["damaged"] = str(exc)
            got = None
        if got is not None:
            c, capacity = got
            lookups = c["hits"] + c["misses"]
            r.update({k: c[k] for k in ("hits", "misses", "evictions", "spills", "corrupt",
                                        "host_blocks", "host_bytes", "disk_blocks",
                                        "disk_bytes")},
                     capacity=capacity, hit_rate=c["hits"] / lookups if lookups else None,
                     occupancy=c["host_bytes"] / capacity if capacity else 0.0)
        out.append(r)
    return Page({"namespaces": out, "node": db.config.node})


def nodes_page(db: Database, grant: Grant | None) -> Page:
    """The cluster's nodes (node-wide), and for each visible collection the bytes of its
    head every node holds: its replication state."""
    withheld = _withheld(grant, "the cluster's nodes")
    nodes = _rows(db, "SELECT name, address, state, heartbeat_at, capacity, tiers FROM nodes "
                      "ORDER BY name") if withheld is None else []
    names = sorted({n["name"] for n in nodes} | {db.config.node})
    replication = []
    for name in db.collections():
        if not visible(grant, name):
            continue
        try:
            version, total, held = db.holdings(name)
        except NotFound:  # dropped since the list was read
            continue
        for node in held:
            if node not in names and withheld is None:
                names.append(node)
        replication.append({"collection": name, "version": version, "nbytes": total,
                            "held": {n: held.get(n, 0) for n in names}})
    report = db.last_replication
    last = None if report is None or withheld is not None else {
        "rounds": [[f"{a} -> {b}" for a, b in r] for r in report.rounds],
        "failed": dict(report.failed), "seconds": report.seconds}
    return Page({"nodes": nodes, "names": names, "replication": replication,
                 "last_replication": last}, withheld)


def policies_page(db: Database, grant: Grant | None) -> Page:
    """The stored policies with their last run, and the latest runs (node-wide)."""
    withheld = _withheld(grant, "policies")
    if withheld is not None:
        return Page({"policies": [], "runs": []}, withheld)
    return Page({
        "policies": _rows(db, "SELECT name, trigger, schedule, statement, enabled, runs, "
                              "last_run_at, last_outcome, last_detail FROM policies "
                              "ORDER BY name"),
        "runs": _rows(db, "SELECT policy, attempt, started_at, finished_at, outcome, detail "
                          "FROM policy_runs ORDER BY started_at DESC LIMIT 50")})


def query_page(db: Database, grant: Grant | None, text: str) -> Page:
    """The result of one read statement of the query language (SELECT, EXPLAIN, SHOW
    POLICIES), at most QUERY_ROWS rows (a SELECT asks the catalog for one more, to
    tell whether there are more, and no further). Any other statement is refused unrun
    (InvalidInput naming it); a bad one is the parser's QueryError."""
    withheld = _withheld(grant, "query results")
    if withheld is not None:
        return Page({"text": text, "columns": [], "rows": []}, withheld)
    if not text.strip():
        return Page({"text": "", "columns": [], "rows": []})
    stmt = query.parse(text)
    if stmt.kind not in READ_STATEMENTS:
        raise InvalidInput(f"the console runs read statements only (SELECT, EXPLAIN, SHOW "
                           f"POLICIES), not {stmt.kind}: run it with 'tensordb query'")
    if isinstance(stmt, query.Select) and (not isinstance(stmt.limit, int)
                                           or stmt.limit > QUERY_ROWS):
        # the catalog reads one row past what is shown, never the whole result
        stmt = dataclasses.replace(stmt, limit=QUERY_ROWS + 1)
    result = query.execute(db, stmt)
    rows: Sequence[dict[str, Any]] = result.slice(0, QUERY_ROWS).to_pylist()
    return Page({"text": text, "columns": result.column_names, "rows": rows,
                 "more": result.num_rows > QUERY_ROWS, "shown": len(rows)})

