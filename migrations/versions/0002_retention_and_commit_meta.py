"""Retention per collection (keep the last N versions) and writer metadata per commit.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("collections") as batch:
        batch.add_column(sa.Column("retain_last", sa.Integer, nullable=True))
    with op.batch_alter_table("commits") as batch:
        batch.add_column(sa.Column("meta", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("commits") as batch:
        batch.drop_column("meta")
    with op.batch_alter_table("collections") as batch:
        batch.drop_column("retain_last")
