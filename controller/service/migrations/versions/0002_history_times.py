"""Each kept step's start and end time (the goodput accounting's step spans).

Revision ID: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    with op.batch_alter_table("history") as batch:
        batch.add_column(sa.Column("started_at", sa.Float))
        batch.add_column(sa.Column("ended_at", sa.Float))


def downgrade() -> None:
    with op.batch_alter_table("history") as batch:
        batch.drop_column("ended_at")
        batch.drop_column("started_at")
