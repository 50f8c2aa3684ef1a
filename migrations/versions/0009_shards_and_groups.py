"""Sharded tensors and group commits.

A distributed trainer's ranks each hold shards of a tensor. ``tensor_shards`` keeps a
sharded row's shards (the row itself keeps one line per tensor, with no segment of its
own and the whole tensor's size); ``commit_groups`` and ``group_parts`` hold a group
transaction while its ranks commit their parts, so the version appears only when the
last part lands, and a group that aborts leaves its parts' segments to gc.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from tensordb.catalog.schema import UTCDateTime

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tensor_shards",
        sa.Column("collection_id", sa.Integer,
                  sa.ForeignKey("collections.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("name", sa.String(1024), primary_key=True),
        sa.Column("first_version", sa.Integer, primary_key=True),
        sa.Column("idx", sa.Integer, primary_key=True),
        sa.Column("rank", sa.Integer, nullable=False),
        sa.Column("offsets", sa.Text, nullable=False),
        sa.Column("shape", sa.Text, nullable=False),
        sa.Column("nbytes", sa.BigInteger, nullable=False),
        sa.Column("checksum", sa.String(32), nullable=False),
        sa.Column("segment_id", sa.String(32), nullable=True),
        sa.Column("offset", sa.BigInteger, nullable=False),
    )
    op.create_index("ix_tensor_shards_segment", "tensor_shards", ["segment_id"])
    op.create_table(
        "commit_groups",
        sa.Column("collection", sa.String(255), primary_key=True),
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("world_size", sa.Integer, nullable=False),
        sa.Column("base", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("version", sa.Integer, nullable=True),
        sa.Column("reason", sa.Text, nullable=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("deadline", UTCDateTime, nullable=False),
    )
    op.create_table(
        "group_parts",
        sa.Column("collection", sa.String(255), primary_key=True),
        sa.Column("group_name", sa.String(255), primary_key=True),
        sa.Column("rank", sa.Integer, primary_key=True),
        sa.Column("holder", sa.String(255), nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("segment_id", sa.String(32), nullable=True),
        sa.Column("part", sa.Text, nullable=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
    )
    op.create_index("ix_group_parts_segment", "group_parts", ["segment_id"])


def downgrade() -> None:
    op.drop_index("ix_group_parts_segment", table_name="group_parts")
    op.drop_table("group_parts")
    op.drop_table("commit_groups")
    op.drop_index("ix_tensor_shards_segment", table_name="tensor_shards")
    op.drop_table("tensor_shards")
