"""Byte quotas per tenant, and each segment's collection.

``quotas`` holds a byte limit per tenant (a scope glob over collection names, as tokens
have). ``segments.collection_id`` names the collection whose commit stored the segment,
so a tenant's stored bytes are the sum of its collections' segments (an extent shared
by several versions is in one segment, counted once); existing segments take the
collection of the rows that point into them.

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from tensordb.catalog.schema import UTCDateTime

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "quotas",
        sa.Column("scope", sa.String(255), primary_key=True),
        sa.Column("max_bytes", sa.BigInteger, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
    )
    with op.batch_alter_table("segments") as batch:
        batch.add_column(sa.Column("collection_id", sa.Integer, nullable=True))
        batch.create_index("ix_segments_collection", ["collection_id", "nbytes"])
    op.execute("UPDATE segments SET collection_id = (SELECT min(t.collection_id) FROM tensors t "
               "WHERE t.segment_id = segments.id)")
    op.execute("UPDATE segments SET collection_id = (SELECT min(s.collection_id) FROM "
               "tensor_shards s WHERE s.segment_id = segments.id) WHERE collection_id IS NULL")


def downgrade() -> None:
    with op.batch_alter_table("segments") as batch:
        batch.drop_index("ix_segments_collection")
        batch.drop_column("collection_id")
    op.drop_table("quotas")
