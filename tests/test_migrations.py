"""Catalog schema: migrated on connect when older, refused when newer."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
from conftest import open_store, remove_store
from sqlalchemy import text

from tensordb.catalog import HEAD_REVISION, current_revision, make_engine, upgrade
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
            assert current_revision(conn) == HEAD_REVISION == "0009"
        assert "segment_sources" in inspect(db.catalog.engine).get_table_names()
        db.import_safetensors("m", src, in_place=True)
        assert torch.equal(db.get("m", "w", verify=True), torch.arange(4.0))
    finally:
        remove_store(db)
