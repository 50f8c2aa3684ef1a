"""Scoped access tokens for the node servers' network API.

``access_tokens`` holds each token's public id, the SHA-256 of its secret, its role
(read, write, admin) and its scope (a glob over collection and KV namespace names).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from tensordb.catalog.schema import UTCDateTime

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "access_tokens",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("secret_hash", sa.String(64), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("scope", sa.String(255), nullable=False),
        sa.Column("note", sa.Text, nullable=True),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.Column("revoked_at", UTCDateTime, nullable=True),
    )


def downgrade() -> None:
    op.drop_table("access_tokens")
