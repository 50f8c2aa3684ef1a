"""Segments committed in place: the file a segment references, and what was recorded of it.

An import in place (``import_safetensors(..., in_place=True)``) on a filesystem that
cannot reflink registers a segment whose bytes are the user's file itself. This table
holds that file's path and its size, mtime and identity (inode, device) at the commit;
every open of the segment compares them and refuses a changed file. A row goes with its
segment (ON DELETE CASCADE): gc forgets the reference and never touches the file.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from tensordb.catalog.schema import UTCDateTime

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "segment_sources",
        sa.Column("segment_id", sa.String(32), nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("nbytes", sa.BigInteger, nullable=False),
        sa.Column("mtime_ns", sa.BigInteger, nullable=False),
        sa.Column("inode", sa.BigInteger, nullable=False),
        sa.Column("dev", sa.BigInteger, nullable=False),
        sa.Column("created_at", UTCDateTime, nullable=False),
        sa.PrimaryKeyConstraint("segment_id", name="pk_segment_sources"),
        sa.ForeignKeyConstraint(["segment_id"], ["segments.id"], ondelete="CASCADE",
                                name="fk_segment_sources_segment_id_segments"),
    )


def downgrade() -> None:
    op.drop_table("segment_sources")
