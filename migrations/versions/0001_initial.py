"""Initial catalog: collections, commits, tensor rows, segments, tags, leases, nodes.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from tensordb.catalog.schema import UTCDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "collections",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("head", sa.Integer, nullable=False, server_default="0"),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_collections"),
        sa.UniqueConstraint("name", name="uq_collections_name"),
    )
    op.create_table(
        "commits",
        sa.Column("collection_id", sa.Integer, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("parent", sa.Integer, nullable=True),
        sa.Column("message", sa.Text, nullable=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("n_tensors", sa.Integer, nullable=False),
        sa.Column("nbytes", sa.BigInteger, nullable=False),
        sa.Column("n_written", sa.Integer, nullable=False),
        sa.Column("written_nbytes", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("collection_id", "version", name="pk_commits"),
        sa.ForeignKeyConstraint(["collection_id"], ["collections.id"], ondelete="CASCADE",
                                name="fk_commits_collection_id_collections"),
    )
    op.create_table(
        "tensors",
        sa.Column("collection_id", sa.Integer, nullable=False),
        sa.Column("name", sa.String(1024), nullable=False),
        sa.Column("first_version", sa.Integer, nullable=False),
        sa.Column("end_version", sa.Integer, nullable=True),
        sa.Column("dtype", sa.String(32), nullable=False),
        sa.Column("shape", sa.Text, nullable=False),
        sa.Column("nbytes", sa.BigInteger, nullable=False),
        sa.Column("checksum", sa.String(32), nullable=False),
        sa.Column("segment_id", sa.String(32), nullable=True),
        sa.Column("offset", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("collection_id", "name", "first_version", name="pk_tensors"),
        sa.ForeignKeyConstraint(["collection_id"], ["collections.id"], ondelete="CASCADE",
                                name="fk_tensors_collection_id_collections"),
    )
    op.create_index("ix_tensors_live", "tensors", ["collection_id", "end_version"])
    op.create_index("ix_tensors_segment", "tensors", ["segment_id"])
    op.create_table(
        "segments",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("nbytes", sa.BigInteger, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_segments"),
    )
    op.create_table(
        "tags",
        sa.Column("collection_id", sa.Integer, nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.PrimaryKeyConstraint("collection_id", "name", name="pk_tags"),
        sa.ForeignKeyConstraint(["collection_id"], ["collections.id"], ondelete="CASCADE",
                                name="fk_tags_collection_id_collections"),
    )
    op.create_table(
        "leases",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("collection_id", sa.Integer, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("holder", sa.String(255), nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("expires_at", UTCDateTime, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_leases"),
        sa.ForeignKeyConstraint(["collection_id"], ["collections.id"], ondelete="CASCADE",
                                name="fk_leases_collection_id_collections"),
    )
    op.create_index("ix_leases_collection", "leases", ["collection_id", "version"])
    op.create_table(
        "nodes",
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("address", sa.String(255), nullable=True),
        sa.Column("tiers", sa.Text, nullable=False, server_default="[]"),
        sa.Column("capacity", sa.BigInteger, nullable=True),
        sa.Column("heartbeat_at", UTCDateTime, nullable=True),
        sa.Column("state", sa.String(16), nullable=False, server_default="up"),
        sa.PrimaryKeyConstraint("name", name="pk_nodes"),
    )


def downgrade() -> None:
    for table in ("nodes", "leases", "tags", "segments", "tensors", "commits", "collections"):
        op.drop_table(table)
