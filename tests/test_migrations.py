"""Catalog schema: created at the head when new, migrated on connect when older, refused
when newer."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import open_store, remove_store
from sqlalchemy import Engine, inspect, text

import migrations
from tensordb.catalog import (
    HEAD_REVISION,
    current_revision,
    ensure_schema,
    make_engine,
    metadata,
    upgrade,
    write_conn,
)
from tensordb.catalog._sql import _KNOWN
from tensordb.errors import IncompatibleStore


def _url(home: Path, catalog_url: str | None) -> str:
    return catalog_url or f"sqlite:///{home / 'catalog.db'}"


def test_new_store_is_at_head(db, catalog_url) -> None:  # type: ignore[no-untyped-def]
    with db.catalog.engine.connect() as conn:
        assert current_revision(conn) == HEAD_REVISION


def test_older_store_is_migrated_on_connect(store_home: Path, catalog_url: str | None) -> None:
    engine = make_engine(_url(store_home, catalog_url))
    upgrade(engine, "0001")
    with engine.begin() as conn:
        assert current_revision(conn) == "0001"
        conn.execute(text("INSERT INTO collections (name, head, created_at) "
                          "VALUES ('old', 0, :t)"), {"t": datetime.now(timezone.utc)})
    engine.dispose()
    db = open_store(store_home, catalog_url)
    try:
        with db.catalog.engine.connect() as conn:
            assert current_revision(conn) == HEAD_REVISION
        assert db.collections() == ["old"]
        db.commit("old", {"w": torch.ones(3)}, metadata={"from": "0001"})
        db.set_retention("old", 1)  # a column added by 0002
        assert db.history("old")[0].metadata == {"from": "0001"}
    finally:
        remove_store(db)


def test_newer_store_is_refused(store_home: Path, catalog_url: str | None) -> None:
    db = open_store(store_home, catalog_url)
    db.commit("c", {"w": torch.ones(3)})
    remove_store(db)
    engine = make_engine(_url(store_home, catalog_url))
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    engine.dispose()
    with pytest.raises(IncompatibleStore) as info:
        open_store(store_home, catalog_url)
    assert "9999" in str(info.value) and HEAD_REVISION in str(info.value)


def test_a_0006_store_gains_segment_sources(store_home: Path, catalog_url: str | None,
                                            tmp_path: Path) -> None:
    from safetensors.torch import save_file
    from sqlalchemy import inspect

    engine = make_engine(_url(store_home, catalog_url))
    upgrade(engine, "0006")
    assert "segment_sources" not in inspect(engine).get_table_names()
    engine.dispose()
    src = tmp_path / "m.safetensors"
    save_file({"w": torch.arange(4.0)}, src)
    db = open_store(store_home, catalog_url)
    try:
        with db.catalog.engine.connect() as conn:
            assert current_revision(conn) == HEAD_REVISION == "0011"
        assert "segment_sources" in inspect(db.catalog.engine).get_table_names()
        db.import_safetensors("m", src, in_place=True)
        assert torch.equal(db.get("m", "w", verify=True), torch.arange(4.0))
    finally:
        remove_store(db)


def test_a_0010_store_gives_its_segments_their_collection(store_home: Path,
                                                          catalog_url: str | None) -> None:
    engine = make_engine(_url(store_home, catalog_url))
    upgrade(engine, "0010")
    now = "2026-01-01 00:00:00"
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO collections (id, name, head, created_at) "
                          "VALUES (7, 'team-a/m', 1, :t)"), {"t": now})
        for sid, n in (("seg-a", 64), ("seg-orphan", 32)):
            conn.execute(text("INSERT INTO segments (id, node, tier, nbytes, created_at) "
                              "VALUES (:id, 'local', 'host', :n, :t)"),
                         {"id": sid, "n": n, "t": now})
        conn.execute(text(
            "INSERT INTO tensors (collection_id, name, first_version, end_version, dtype, "
            "shape, nbytes, checksum, segment_id, \"offset\") VALUES (7, 'w', 1, NULL, "
            "'float32', '16', 64, '0', 'seg-a', 0)"))
    engine.dispose()
    db = open_store(store_home, catalog_url)
    try:
        with db.catalog.engine.connect() as conn:
            got = dict(conn.execute(text("SELECT id, collection_id FROM segments")).all())
        assert got == {"seg-a": 7, "seg-orphan": None}
        db.set_quota("team-a/*", 100)
        assert [(q.scope, q.used_bytes) for q in db.quotas()] == [("team-a/*", 64)]
    finally:
        remove_store(db)


# -- a new catalog is created from schema.metadata, not by the migrations -----------------


@pytest.fixture
def url_pair(catalog_url: str | None, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Two empty catalog databases on the backend under test."""
    if catalog_url is None:
        yield f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}"
        return
    from conftest import PG_BASE, _pg_admin

    name = f"tensordb_test_{uuid.uuid4().hex[:12]}"
    admin = _pg_admin()
    with admin.connect() as c:
        c.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield catalog_url, f"{PG_BASE}/{name}"
    finally:
        with admin.connect() as c:
            c.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _described(value: Any) -> Any:
    """Reflected values made comparable: clauses (partial-index WHERE) as their text."""
    if isinstance(value, dict):
        return {k: _described(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_described(v) for v in value]
    if hasattr(value, "text"):
        return " ".join(str(value.text).split())
    return value


def _schema(engine: Engine) -> dict[str, Any]:
    """Everything the inspector reflects of the catalog's tables, Alembic's included."""
    insp = inspect(engine)
    tables: dict[str, Any] = {}
    for name in sorted(insp.get_table_names()):
        tables[name] = _described({
            "columns": [(c["name"], repr(c["type"]), c["nullable"], c["default"],
                         c.get("autoincrement"), c.get("identity"), c.get("computed"))
                        for c in insp.get_columns(name)],
            "pk": insp.get_pk_constraint(name),
            "indexes": sorted(insp.get_indexes(name), key=lambda i: i["name"] or ""),
            "fks": sorted(insp.get_foreign_keys(name), key=lambda f: f["name"] or ""),
            "uniques": sorted(insp.get_unique_constraints(name), key=lambda u: u["name"] or ""),
            "checks": sorted(insp.get_check_constraints(name), key=lambda u: u["name"] or ""),
        })
    out: dict[str, Any] = {"tables": tables}
    if engine.dialect.name == "postgresql":
        out["sequences"] = sorted(insp.get_sequence_names())
    else:  # the DDL of each index as SQLite keeps it (the WHERE of partial ones with it)
        with engine.connect() as conn:
            out["index_sql"] = sorted(
                (n, " ".join(s.split())) for n, s in conn.exec_driver_sql(
                    "SELECT name, sql FROM sqlite_master WHERE type = 'index' "
                    "AND sql IS NOT NULL"))
    return out


def _metadata_diffs(engine: Engine) -> list[Any]:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    with engine.connect() as conn:
        return list(compare_metadata(MigrationContext.configure(conn), metadata))


def test_a_new_catalog_has_the_schema_the_migrations_build(
        url_pair: tuple[str, str]) -> None:
    """A catalog with no tables is created from schema.metadata and stamped at the head:
    the same tables, columns (types, nullability, defaults), keys, indexes (with their
    WHERE clauses), foreign keys, constraints and version row as the nine revisions
    run one by one give, and Alembic's own comparison finds nothing to migrate."""
    created, migrated = (make_engine(u) for u in url_pair)
    try:
        ensure_schema(created)
        upgrade(migrated)
        with created.connect() as conn:
            assert current_revision(conn) == HEAD_REVISION
            assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 1
        with migrated.connect() as conn:
            assert current_revision(conn) == HEAD_REVISION
        a, b = _schema(created), _schema(migrated)
        assert set(a["tables"]) == set(metadata.tables) | {"alembic_version"}
        assert a["tables"]["tensors"]["indexes"][0]["dialect_options"]  # a WHERE, reflected
        assert a == b
        assert _metadata_diffs(migrated) == []
        assert _metadata_diffs(created) == []
    finally:
        created.dispose()
        migrated.dispose()


def test_head_revision_is_alembic_head() -> None:
    """HEAD_REVISION (what a new catalog is stamped with) and _KNOWN (the revisions this
    code opens) are the migrations' own: a new revision that forgets either fails here."""
    from alembic.config import Config as AlembicConfig
    from alembic.script import ScriptDirectory

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    scripts = ScriptDirectory.from_config(cfg)
    assert scripts.get_heads() == [HEAD_REVISION]
    chain = [r.revision for r in scripts.walk_revisions("base", "heads")][::-1]
    assert tuple(chain) == _KNOWN and chain[-1] == HEAD_REVISION


def test_a_new_store_opens_without_alembic(store_home: Path, catalog_url: str | None) -> None:
    code = ("import sys, tensordb\n"
            f"db = tensordb.connect({catalog_url!r}, home={str(store_home)!r})\n"
            "db.commit('c', {'w': __import__('torch').ones(2)})\n"
            "db.close()\n"
            "assert 'alembic' not in sys.modules, 'alembic imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    engine = make_engine(_url(store_home, catalog_url))
    try:
        with engine.connect() as conn:
            assert current_revision(conn) == HEAD_REVISION
    finally:
        engine.dispose()


def test_a_failed_creation_leaves_nothing(store_home: Path, catalog_url: str | None) -> None:
    """The tables and the version row are one transaction: a creation that fails part
    way leaves no table behind (a catalog stamped with part of its schema would never be
    migrated), and the next connect creates it whole."""
    from sqlalchemy import event

    def fail(*_: Any, **__: Any) -> None:
        raise RuntimeError("failed after some tables")

    table = metadata.tables["tensor_shards"]
    event.listen(table, "after_create", fail)
    engine = make_engine(_url(store_home, catalog_url))
    try:
        with pytest.raises(RuntimeError, match="failed after"):
            ensure_schema(engine)
        event.remove(table, "after_create", fail)
        assert inspect(engine).get_table_names() == []
        ensure_schema(engine)
        assert _metadata_diffs(engine) == []
    finally:
        if event.contains(table, "after_create", fail):
            event.remove(table, "after_create", fail)
        engine.dispose()


def test_a_database_with_other_tables_is_migrated(store_home: Path,
                                                  catalog_url: str | None) -> None:
    """Only a database with no tables at all is created directly: one holding any other
    table (shared with another application) takes the migrations, which leave it be."""
    engine = make_engine(_url(store_home, catalog_url))
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE theirs (x INTEGER)"))
            conn.execute(text("INSERT INTO theirs VALUES (7)"))
        ensure_schema(engine)
        with engine.connect() as conn:
            assert current_revision(conn) == HEAD_REVISION
            assert conn.execute(text("SELECT x FROM theirs")).scalar() == 7
        assert set(inspect(engine).get_table_names()) == (
            set(metadata.tables) | {"alembic_version", "theirs"})
    finally:
        engine.dispose()


#: the revision a later tensordb would add
FUTURE = f"{int(HEAD_REVISION) + 1:04d}"


def _future_scripts(tmp_path: Path) -> Path:
    """A copy of migrations/ with one more revision, as a later tensordb would ship."""
    folder = tmp_path / "migrations"
    shutil.copytree(Path(migrations.__file__).parent, folder,
                    ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "versions" / f"{FUTURE}_future.py").write_text(textwrap.dedent(f'''
        import sqlalchemy as sa
        from alembic import op

        revision = {FUTURE!r}
        down_revision = {HEAD_REVISION!r}
        branch_labels = None
        depends_on = None


        def upgrade() -> None:
            op.create_table("future", sa.Column("id", sa.Integer, primary_key=True))
            with op.batch_alter_table("collections") as batch:
                batch.add_column(sa.Column("future_note", sa.Text, nullable=True))
            op.create_index("ix_tensors_future", "tensors", ["dtype"])


        def downgrade() -> None:
            pass
    '''))
    return folder


def test_a_new_catalog_takes_later_migrations(store_home: Path, catalog_url: str | None,
                                               tmp_path: Path) -> None:
    """A catalog created at the head is one Alembic knows: at its head, `upgrade head`
    changes nothing, and a later revision applies to it like to a migrated one."""
    from alembic import command
    from alembic.config import Config as AlembicConfig
    from alembic.migration import MigrationContext
    from alembic.script import ScriptDirectory

    db = open_store(store_home, catalog_url)
    db.commit("c", {"w": torch.ones(3)})
    remove_store(db)
    engine = make_engine(_url(store_home, catalog_url))
    try:
        before = _schema(engine)

        def run(folder: Path) -> str | None:
            cfg = AlembicConfig()
            cfg.set_main_option("script_location", str(folder))
            with write_conn(engine) as conn:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
            assert ScriptDirectory.from_config(cfg).get_current_head() is not None
            with engine.connect() as conn:
                return MigrationContext.configure(conn).get_current_revision()

        assert run(Path(migrations.__file__).parent) == HEAD_REVISION
        assert _schema(engine) == before  # a no-op
        assert run(_future_scripts(tmp_path)) == FUTURE
        after = _schema(engine)["tables"]
        assert "future" in after
        assert "future_note" in [c[0] for c in after["collections"]["columns"]]
        with engine.connect() as conn:
            assert conn.execute(text("SELECT name FROM collections")).scalars().all() == ["c"]
    finally:
        engine.dispose()
    with pytest.raises(IncompatibleStore, match=FUTURE):
        open_store(store_home, catalog_url)


def _create(url: str, barrier: Any, results: Any) -> None:
    engine = make_engine(url)
    try:
        barrier.wait(60)
        ensure_schema(engine)
        with engine.connect() as conn:
            results.put(current_revision(conn))
    except BaseException as exc:
        results.put(repr(exc))
        raise
    finally:
        engine.dispose()


def test_processes_creating_one_new_catalog_at_once(catalog_url: str | None,
                                                    tmp_path: Path) -> None:
    """The ranks of a job opening one new store together: each waits on the migration
    lock, the first creates the schema, the others find it at the head; none fails, and
    the catalog is created once (one version row, the same schema as alone)."""
    import multiprocessing as mp

    url = _url(tmp_path / "store", catalog_url)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tensordb", "conftest"])  # as test_processes
    n = 4
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_create, args=(url, barrier, results)) for _ in range(n)]
    for proc in procs:
        proc.start()
    revs = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(30)
    assert revs == [HEAD_REVISION] * n
    assert [proc.exitcode for proc in procs] == [0] * n
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).all() == [
                (HEAD_REVISION,)]
        assert _metadata_diffs(engine) == []
    finally:
        engine.dispose()
