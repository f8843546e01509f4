"""A node's reason is text of any length (a lost node's and a release's run past 64 characters, which
PostgreSQL refused; SQLite never checked).

Revision ID: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.alter_column("reason", type_=sa.Text, existing_type=sa.String(64), existing_nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.alter_column("reason", type_=sa.String(64), existing_type=sa.Text, existing_nullable=False)
