"""The router's tables (KsanaLLM's ``node_info``, ``comm_group_pair``, ``inference_group_status``) and the database
they live in.

The storage seam is the database URL: ``--db router.db`` is a SQLite file (the embedded default); a URL such as
``postgresql://...`` or ``mysql+pymysql://...`` passes through to SQLAlchemy, so a server database shared by
several routers can take its place (its driver is the user's to install). Tables are created when missing.

Every transaction runs on one worker thread (``Storage.run``): the trio loop that serves HTTP never waits on the
database, and the registry's read-modify-write passes (a heartbeat recomputes groups and pairs) never interleave
within one router.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import trio
from sqlalchemy import JSON, Boolean, DateTime, Enum, Integer, String, Text, UniqueConstraint, create_engine
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

T = TypeVar("T")

ROLES = ("prefill", "decode")
_Role = Enum(*ROLES, name="node_role")


class Base(DeclarativeBase):
    pass


class NodeInfo(Base):
    """One registered node (one process; a group of ``world_size`` devices may span several)."""

    __tablename__ = "node_info"
    __table_args__ = (UniqueConstraint("cluster_name", "inference_addr", "role", "node_rank"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    node_id: Mapped[str] = mapped_column(String(64), unique=True)
    cluster_name: Mapped[str] = mapped_column(String(255), index=True)
    inference_addr: Mapped[str] = mapped_column(String(255))  # "host:port" of the group's HTTP server
    coordinator_addr: Mapped[str] = mapped_column(String(255))  # bare "IP:port" of the node's control channel
    role: Mapped[str] = mapped_column(_Role)
    node_rank: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    device_num: Mapped[int] = mapped_column(Integer)
    last_heartbeat: Mapped[datetime] = mapped_column(DateTime)  # naive UTC, as SQLite keeps no zone
    is_online: Mapped[bool] = mapped_column(Boolean)
    start_time: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    updated_at: Mapped[datetime] = mapped_column(DateTime)
    # The rest of the registration body, kept for ``GET /nodes``.
    hostname: Mapped[str] = mapped_column(String(255), default="")
    devices: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    job_id: Mapped[str | None] = mapped_column(String(255), nullable=True)
    comm_id: Mapped[str | None] = mapped_column(Text, nullable=True)


class CommGroupPair(Base):
    """One prefill group paired with one decode group; requests go to active pairs."""

    __tablename__ = "comm_group_pair"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    comm_key: Mapped[str] = mapped_column(String(511), unique=True)  # "<prefill_addr>__<decode_addr>"
    is_active: Mapped[bool] = mapped_column(Boolean, default=False)
    cluster_name: Mapped[str] = mapped_column(String(255), index=True)
    prefill_addr: Mapped[str] = mapped_column(String(255))
    decode_addr: Mapped[str] = mapped_column(String(255))
    # [[node_rank, device_id, coordinator_addr], ...]: the prefill group's devices first, then the decode group's.
    control_channel_meta: Mapped[list[list[Any]] | None] = mapped_column(JSON, nullable=True)
    data_channel_meta: Mapped[str | None] = mapped_column(Text, nullable=True)  # the comm id prefill rank 0 sent
    updated_at: Mapped[datetime] = mapped_column(DateTime)


class InferenceGroupStatus(Base):
    """One group (the nodes sharing an ``inference_addr`` and a role) and whether all its devices are online."""

    __tablename__ = "inference_group_status"
    __table_args__ = (UniqueConstraint("cluster_name", "inference_addr", "role"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    cluster_name: Mapped[str] = mapped_column(String(255), index=True)
    inference_addr: Mapped[str] = mapped_column(String(255))
    role: Mapped[str] = mapped_column(_Role)
    world_size_expected: Mapped[int] = mapped_column(Integer)
    online_device_sum: Mapped[int] = mapped_column(Integer)
    online_node_count: Mapped[int] = mapped_column(Integer)
    is_ready: Mapped[bool] = mapped_column(Boolean)
    last_computed_at: Mapped[datetime] = mapped_column(DateTime)


def database_url(db: str) -> str:
    """``--db``: a URL (``scheme://...``) passes through; anything else is the path of a SQLite file."""
    if "://" in db:
        return db
    return f"sqlite:///{Path(db).expanduser().resolve()}"


class Storage:
    """The engine, its tables, and the one thread every transaction runs on."""

    def __init__(self, db: str) -> None:
        self.url = database_url(db)
        sqlite = self.url.startswith("sqlite")
        # SQLite connections are made on the worker thread trio picks for each call, not the creating one.
        self.engine: Engine = create_engine(self.url, connect_args={"check_same_thread": False} if sqlite else {},
                                            pool_pre_ping=not sqlite)
        Base.metadata.create_all(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._limiter = trio.CapacityLimiter(1)

    def transaction(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(session, *args)`` in one transaction, committed when it returns, rolled back when it raises."""
        with self._sessions.begin() as session:
            return fn(session, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``transaction(fn, *args)`` on the storage thread, so the trio loop keeps serving meanwhile."""
        return await trio.to_thread.run_sync(partial(self.transaction, fn, *args), limiter=self._limiter)

    def close(self) -> None:
        self.engine.dispose()

