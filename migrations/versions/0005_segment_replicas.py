"""Segment replicas: which other nodes hold a copy of a segment's bytes.

A segment is written by one node (``segments.node``); cluster mode copies it node to
node over Arrow Flight, and each verified copy is a row here. A replica row goes away
with its segment (ON DELETE CASCADE), after which the replica node's orphan reclaim
deletes the file.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from tensordb.catalog.schema import UTCDateTime

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "segment_replicas",
        sa.Column("segment_id", sa.String(32), nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.PrimaryKeyConstraint("segment_id", "node", name="pk_segment_replicas"),
        sa.ForeignKeyConstraint(["segment_id"], ["segments.id"], ondelete="CASCADE",
                                name="fk_segment_replicas_segment_id_segments"),
    )
    op.create_index("ix_segment_replicas_node", "segment_replicas", ["node"])


def downgrade() -> None:
    op.drop_index("ix_segment_replicas_node", table_name="segment_replicas")
    op.drop_table("segment_replicas")
