"""Alembic environment for the tensordb catalog.

``tensordb`` runs it on connect with an open connection in ``config.attributes``;
the alembic command works too, given a config that names this folder (there is no
alembic.ini): ``alembic -c x.ini -x url=... upgrade head`` from the repository root,
x.ini holding ``[alembic]`` and ``script_location = migrations``.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from tensordb.catalog.schema import metadata

config = context.config
connection = config.attributes.get("connection")


def _run(conn: object) -> None:
    context.configure(connection=conn, target_metadata=metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


if connection is not None:
    _run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option(
        "sqlalchemy.url"
    )
    engine = create_engine(url)
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()
