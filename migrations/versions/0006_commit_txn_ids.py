"""A client-chosen id per commit, so a commit retried after a lost connection lands once.

A writer that loses its catalog connection while its COMMIT is in flight cannot tell
whether the commit landed. It retries with the same id: if a commit with that id is
already there, that is the result; otherwise the commit had rolled back and is made
again. The unique index makes "once" a constraint, not a convention.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("commits") as batch:
        batch.add_column(sa.Column("txn_id", sa.String(32), nullable=True))
    op.create_index("uq_commits_txn_id", "commits", ["txn_id"], unique=True)


def downgrade() -> None:
    op.drop_index("uq_commits_txn_id", table_name="commits")
    with op.batch_alter_table("commits") as batch:
        batch.drop_column("txn_id")
