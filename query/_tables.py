"""The virtual tables a SELECT reads, each mapped onto the catalog's tables.

A virtual table is a base catalog table, the joins some of its columns need (made only
when a statement uses such a column: a join on a primary or foreign key changes no row
count, so leaving it out changes nothing but the cost), the conditions that always
apply (``tensors``: head rows only) and its columns, each a SQLAlchemy expression with
a kind: 'int', 'float', 'str', 'time' or 'bool'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Boolean, DateTime, Integer, Numeric, String, and_, func, select
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.types import TypeDecorator

from tensordb.catalog.schema import (
    collections,
    commits,
    kv_namespaces,
    leases,
    nodes,
    pins,
    policies,
    policy_runs,
    segments,
    tags,
    tensors,
)

__all__ = ["VColumn", "VJoin", "VTable", "TABLES", "kind_of"]


def kind_of(type_: Any) -> str | None:
    """The kind of a SQLAlchemy type: 'int', 'float', 'str', 'time', 'bool' (None: unknown)."""
    if isinstance(type_, TypeDecorator):
        type_ = type_.impl
    if isinstance(type_, Boolean):
        return "bool"
    if isinstance(type_, Integer):
        return "int"
    if isinstance(type_, Numeric):
        return "float"
    if isinstance(type_, DateTime):
        return "time"
    if isinstance(type_, String):
        return "str"
    return None


@dataclass(frozen=True)
class VColumn:
    name: str
    expr: ColumnElement[Any]
    source: str  # what it reads, for EXPLAIN
    needs: tuple[str, ...] = ()  # joins, by name

    @property
    def kind(self) -> str | None:
        return kind_of(self.expr.type)


@dataclass(frozen=True)
class VJoin:
    name: str
    target: Any
    on: ColumnElement[bool]
    outer: bool
    text: str  # for EXPLAIN


@dataclass(frozen=True)
class VTable:
    name: str
    doc: str
    base: Any
    columns: dict[str, VColumn]
    joins: tuple[VJoin, ...] = ()
    where: tuple[ColumnElement[bool], ...] = ()
    where_text: str = ""

    def from_clause(self, needed: set[str]) -> Any:
        """The base table with only the joins ``needed`` (in their declared order)."""
        src = self.base
        for j in self.joins:
            if j.name in needed:
                src = src.outerjoin(j.target, j.on) if j.outer else src.join(j.target, j.on)
        return src


def _cols(*specs: tuple[str, ColumnElement[Any], str] | tuple[str, ColumnElement[Any], str,
                                                                tuple[str, ...]]
          ) -> dict[str, VColumn]:
    out = {}
    for spec in specs:
        name, expr, source = spec[0], spec[1], spec[2]
        needs = spec[3] if len(spec) > 3 else ()
        out[name] = VColumn(name, expr, source, needs)
    return out


t, c, s = tensors.c, collections.c, segments.c
_COLL = VJoin("collections", collections, collections.c.id == tensors.c.collection_id, False,
              "JOIN collections ON collections.id = tensors.collection_id")
_SEG = VJoin("segments", segments, segments.c.id == tensors.c.segment_id, True,
             "LEFT JOIN segments ON segments.id = tensors.segment_id")


def _tensor_columns(head: bool) -> dict[str, VColumn]:
    version = [("version", t.first_version, "tensors.first_version")] if head else [
        ("first_version", t.first_version, "tensors.first_version"),
        ("end_version", t.end_version, "tensors.end_version (NULL: still in the head)")]
    return _cols(
        ("collection", c.name, "collections.name", ("collections",)),
        ("name", t.name, "tensors.name"),
        *version,
        ("dtype", t.dtype, "tensors.dtype"),
        ("shape", t.shape, "tensors.shape ('4096,4096'; '' for a 0-d tensor)"),
        ("nbytes", t.nbytes, "tensors.nbytes"),
        ("checksum", t.checksum, "tensors.checksum"),
        ("segment", t.segment_id, "tensors.segment_id"),
        ("offset", t.offset, "tensors.offset"),
        ("tier", s.tier, "segments.tier", ("segments",)),
        ("node", s.node, "segments.node", ("segments",)),
    )


def _by_collection(table: Any, name: str) -> VJoin:
    return VJoin("collections", collections, collections.c.id == table.c.collection_id, False,
                 f"JOIN collections ON collections.id = {name}.collection_id")


_head = commits.alias("head_commit")
_last_run = policy_runs.alias("last_run")
_runs = policy_runs.alias("runs")
_n_versions = (select(func.count()).where(commits.c.collection_id == collections.c.id)
               .correlate(collections).scalar_subquery())
_n_runs = (select(func.count()).where(_runs.c.policy == policies.c.name)
           .correlate(policies).scalar_subquery())
_last_id = (select(func.max(_runs.c.id)).where(_runs.c.policy == policies.c.name)
            .correlate(policies).scalar_subquery())

TABLES: dict[str, VTable] = {
    "tensors": VTable(
        "tensors", "the head version's tensor rows, one per (collection, name)",
        tensors, _tensor_columns(True), (_COLL, _SEG), (t.end_version.is_(None),),
        "tensors.end_version IS NULL"),
    "versions": VTable(
        "versions", "every retained tensor row: part of each version v with first_version "
        "<= v < end_version (end_version NULL: still in the head)",
        tensors, _tensor_columns(False), (_COLL, _SEG)),
    "collections": VTable(
        "collections", "one row per collection; tensors and nbytes of its head version",
        collections, _cols(
            ("name", c.name, "collections.name"),
            ("head", c.head, "collections.head"),
            ("retain_last", c.retain_last, "collections.retain_last"),
            ("created_at", c.created_at, "collections.created_at"),
            ("tensors", func.coalesce(_head.c.n_tensors, 0), "head_commit.n_tensors", ("head",)),
            ("nbytes", func.coalesce(_head.c.nbytes, 0), "head_commit.nbytes", ("head",)),
            ("versions", _n_versions, "count(commits) of the collection"),
        ),
        (VJoin("head", _head, and_(_head.c.collection_id == c.id, _head.c.version == c.head),
               True, "LEFT JOIN commits AS head_commit ON the collection's head version"),)),
    "commits": VTable(
        "commits", "one row per retained version of each collection",
        commits, _cols(
            ("collection", c.name, "collections.name", ("collections",)),
            ("version", commits.c.version, "commits.version"),
            ("parent", commits.c.parent, "commits.parent"),
            ("message", commits.c.message, "commits.message"),
            ("created_at", commits.c.created_at, "commits.created_at"),
            ("tensors", commits.c.n_tensors, "commits.n_tensors"),
            ("nbytes", commits.c.nbytes, "commits.nbytes"),
            ("written", commits.c.n_written, "commits.n_written"),
            ("written_nbytes", commits.c.written_nbytes, "commits.written_nbytes"),
            ("metadata", commits.c.meta, "commits.meta (JSON text)"),
        ),
        (_by_collection(commits, "commits"),)),
    "tags": VTable(
        "tags", "one row per tag", tags, _cols(
            ("collection", c.name, "collections.name", ("collections",)),
            ("tag", tags.c.name, "tags.name"),
            ("version", tags.c.version, "tags.version"),
            ("created_at", tags.c.created_at, "tags.created_at"),
        ), (_by_collection(tags, "tags"),)),
    "extents": VTable(
        "extents", "one row per stored segment (the extents of many tensors)", segments, _cols(
            ("segment", s.id, "segments.id"),
            ("node", s.node, "segments.node"),
            ("tier", s.tier, "segments.tier"),
            ("nbytes", s.nbytes, "segments.nbytes"),
            ("created_at", s.created_at, "segments.created_at"),
            ("collection", c.name, "collections.name of segments.collection_id (the "
             "collection whose commit stored it)", ("collections",)),
        ), (VJoin("collections", collections, collections.c.id == s.collection_id, True,
                  "LEFT JOIN collections ON collections.id = segments.collection_id"),)),
    "nodes": VTable(
        "nodes", "one row per node of the cluster", nodes, _cols(
            ("name", nodes.c.name, "nodes.name"),
            ("address", nodes.c.address, "nodes.address"),
            ("tiers", nodes.c.tiers, "nodes.tiers (JSON text)"),
            ("capacity", nodes.c.capacity, "nodes.capacity"),
            ("heartbeat_at", nodes.c.heartbeat_at, "nodes.heartbeat_at"),
            ("state", nodes.c.state, "nodes.state"),
        )),
    "leases": VTable(
        "leases", "one row per lease a reader holds on a version", leases, _cols(
            ("lease", leases.c.id, "leases.id"),
            ("collection", c.name, "collections.name", ("collections",)),
            ("version", leases.c.version, "leases.version"),
            ("holder", leases.c.holder, "leases.holder"),
            ("node", leases.c.node, "leases.node"),
            ("created_at", leases.c.created_at, "leases.created_at"),
            ("expires_at", leases.c.expires_at, "leases.expires_at"),
        ), (_by_collection(leases, "leases"),)),
    "kv_namespaces": VTable(
        "kv_namespaces", "one row per KV block store and node", kv_namespaces, _cols(
            ("name", kv_namespaces.c.name, "kv_namespaces.name"),
            ("block_tokens", kv_namespaces.c.block_tokens, "kv_namespaces.block_tokens"),
            ("node", kv_namespaces.c.node, "kv_namespaces.node"),
            ("blocks", kv_namespaces.c.blocks, "kv_namespaces.blocks"),
            ("nbytes", kv_namespaces.c.nbytes, "kv_namespaces.nbytes"),
            ("created_at", kv_namespaces.c.created_at, "kv_namespaces.created_at"),
        )),
    "pins": VTable(
        "pins", "one row per pinned (collection, version, tier)", pins, _cols(
            ("collection", c.name, "collections.name", ("collections",)),
            ("version", pins.c.version, "pins.version"),
            ("tier", pins.c.tier, "pins.tier"),
            ("created_at", pins.c.created_at, "pins.created_at"),
        ), (_by_collection(pins, "pins"),)),
    "policies": VTable(
        "policies", "one row per stored policy, with its last run", policies, _cols(
            ("name", policies.c.name, "policies.name"),
            ("trigger", policies.c.trigger, "policies.trigger ('every', 'cron', 'commit')"),
            ("schedule", policies.c.schedule, "policies.schedule"),
            ("statement", policies.c.statement, "policies.statement"),
            ("enabled", policies.c.enabled, "policies.enabled"),
            ("created_at", policies.c.created_at, "policies.created_at"),
            ("runs", _n_runs, "count(policy_runs) of the policy"),
            ("last_run_at", _last_run.c.started_at, "last_run.started_at", ("last_run",)),
            ("last_finished_at", _last_run.c.finished_at, "last_run.finished_at",
             ("last_run",)),
            ("last_outcome", _last_run.c.outcome, "last_run.outcome", ("last_run",)),
            ("last_detail", _last_run.c.detail, "last_run.detail", ("last_run",)),
        ),
        (VJoin("last_run", _last_run, and_(_last_run.c.policy == policies.c.name,
                                           _last_run.c.id == _last_id), True,
               "LEFT JOIN policy_runs AS last_run ON the policy's latest run"),)),
    "policy_runs": VTable(
        "policy_runs", "one row per run of a policy", policy_runs, _cols(
            ("id", policy_runs.c.id, "policy_runs.id"),
            ("policy", policy_runs.c.policy, "policy_runs.policy"),
            ("attempt", policy_runs.c.attempt, "policy_runs.attempt"),
            ("started_at", policy_runs.c.started_at, "policy_runs.started_at"),
            ("finished_at", policy_runs.c.finished_at, "policy_runs.finished_at"),
            ("outcome", policy_runs.c.outcome, "policy_runs.outcome ('ok' or 'error')"),
            ("detail", policy_runs.c.detail, "policy_runs.detail"),
        )),
}
