"""The (collection, end_version) index covers closed rows only.

Revision 0001 indexed every tensor row by (collection_id, end_version). A statement that
looks a head row up by name (``collection_id = ? AND end_version IS NULL AND name = ...``:
every commit's close and the writer's dedupe look-up) matched that index as well as the
partial unique index on head rows (``uq_tensors_head``, 0003), and a planner whose
statistics were older than the last bulk commit took the first one and read every live
row of the collection, filtering by name: measured on PostgreSQL, a 1-tensor commit into
a 100,000-tensor collection cost 60 ms against 11 ms at 1,000 tensors. Head rows are
served by ``uq_tensors_head`` (by collection, and by collection and name); what else
needs (collection_id, end_version) reads closed rows (gc, a version's manifest, the
conflict check), so the index now holds only those: ``ix_tensors_closed``.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_tensors_live", table_name="tensors")
    op.create_index("ix_tensors_closed", "tensors", ["collection_id", "end_version"],
                    sqlite_where=sa.text("end_version IS NOT NULL"),
                    postgresql_where=sa.text("end_version IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("ix_tensors_closed", table_name="tensors")
    op.create_index("ix_tensors_live", "tensors", ["collection_id", "end_version"])
