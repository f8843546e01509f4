"""The registry as goodput first made it: runs, attempts, events, history, checkpoints, nodes.

Revision ID: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("seq", sa.Integer, nullable=False, unique=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("loss", sa.Float),
        sa.Column("error", sa.JSON),
        sa.Column("view", sa.JSON),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_table(
        "attempts",
        sa.Column("run_id", sa.String(128), primary_key=True),
        sa.Column("attempt", sa.Integer, primary_key=True),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("mesh", sa.JSON),
        sa.Column("placement", sa.JSON),
        sa.Column("start_step", sa.Integer, nullable=False),
        sa.Column("resume_step", sa.Integer),
        sa.Column("ended_at", sa.Float),
        sa.Column("ended_by", sa.String(64)),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(128), nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("detail", sa.JSON, nullable=False),
        sa.UniqueConstraint("run_id", "seq"),
    )
    op.create_index("ix_events_run_id", "events", ["run_id"])
    op.create_table(
        "history",
        sa.Column("run_id", sa.String(128), primary_key=True),
        sa.Column("step", sa.Integer, primary_key=True),
        sa.Column("loss", sa.Float),
        sa.Column("attempt", sa.Integer, nullable=False),
    )
    op.create_table(
        "checkpoints",
        sa.Column("run_id", sa.String(128), primary_key=True),
        sa.Column("step", sa.Integer, primary_key=True),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("committed_at", sa.Float, nullable=False),
        sa.Column("uri", sa.String(1024)),
        sa.Column("bytes", sa.Integer),
        sa.Column("seconds", sa.Float),
        sa.Column("state", sa.String(16), nullable=False,
                  comment="committed, retired (by retention) or discarded (rollback)"),
    )
    op.create_table(
        "nodes",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("run_id", sa.String(128)),
        sa.Column("time", sa.Float, nullable=False),
    )


def downgrade() -> None:
    for table in ("nodes", "checkpoints", "history", "events", "attempts", "runs"):
        op.drop_table(table)
