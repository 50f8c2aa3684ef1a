"""Pins (versions kept in a tier), stored policies with their run log, KV namespaces.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from tensordb.catalog.schema import UTCDateTime

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pins",
        sa.Column("collection_id", sa.Integer, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.PrimaryKeyConstraint("collection_id", "version", "tier", name="pk_pins"),
        sa.ForeignKeyConstraint(["collection_id"], ["collections.id"], ondelete="CASCADE",
                                name="fk_pins_collection_id_collections"),
    )
    op.create_table(
        "policies",
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("trigger", sa.String(16), nullable=False),
        sa.Column("schedule", sa.Text, nullable=False),
        sa.Column("statement", sa.Text, nullable=False),
        sa.Column("enabled", sa.Boolean, nullable=False, server_default=sa.true()),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_policies"),
    )
    op.create_table(
        "policy_runs",
        sa.Column("id", sa.Integer, autoincrement=True, nullable=False),
        sa.Column("policy", sa.String(255), nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False, server_default="1"),
        sa.Column("started_at", UTCDateTime, nullable=False),
        sa.Column("finished_at", UTCDateTime, nullable=True),
        sa.Column("outcome", sa.String(16), nullable=False),
        sa.Column("detail", sa.Text, nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_policy_runs"),
    )
    op.create_index("ix_policy_runs_policy", "policy_runs", ["policy", "started_at"])
    op.create_table(
        "kv_namespaces",
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("block_tokens", sa.Integer, nullable=False),
        sa.Column("node", sa.String(255), nullable=False),
        sa.Column("blocks", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("nbytes", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.PrimaryKeyConstraint("name", "node", name="pk_kv_namespaces"),
    )


def downgrade() -> None:
    for table in ("kv_namespaces", "policy_runs", "policies", "pins"):
        op.drop_table(table)
