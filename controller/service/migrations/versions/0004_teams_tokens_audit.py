"""A service many teams share (issue 45): teams (with a GPU quota), API tokens (a hash each, never the
token), the audit log of mutating requests, and the team each run belongs to (`default` for the runs
made before teams).

Revision ID: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("team", sa.String(64), nullable=False, server_default="default"))
    op.create_table(
        "teams",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("gpu_quota", sa.Integer, comment="GPUs its runs may hold at once; NULL: no limit"),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_table(
        "tokens",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False, comment="the person or automation it was made for"),
        sa.Column("team", sa.String(64), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("secret_hash", sa.String(256), nullable=False, comment="scrypt of the token's secret; never the token"),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("created_by", sa.String(128), nullable=False),
        sa.Column("revoked_at", sa.Float),
    )
    op.create_table(
        "audit",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("who", sa.String(128), nullable=False),
        sa.Column("team", sa.String(64)),
        sa.Column("role", sa.String(16)),
        sa.Column("via", sa.String(16)),
        sa.Column("method", sa.String(8), nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("status", sa.Integer, nullable=False),
        sa.Column("detail", sa.JSON),
    )
    op.create_index("ix_audit_time", "audit", ["time"])
    op.execute(sa.text("INSERT INTO teams (name, gpu_quota, created_at) VALUES ('default', NULL, 0)"))


def downgrade() -> None:
    op.drop_index("ix_audit_time", "audit")
    op.drop_table("audit")
    op.drop_table("tokens")
    op.drop_table("teams")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("team")
