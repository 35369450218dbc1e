"""KsanaLLM's node registry: RegisterNode, Heartbeat and RegisterCommId, and the rules that pair groups.

A *group* is the nodes of one role that share an ``inference_addr`` (a tensor-parallel server may span several
nodes; requests go to rank 0's address). It is **ready** when the ``device_num`` of its online nodes sums to its
``world_size`` (the largest any of its nodes registered). A node is online while its last heartbeat is younger than
``heartbeat_timeout_s``.

Pairs (``comm_group_pair``), under KsanaLLM's rules:
- a heartbeat creates a pair, keyed ``"<prefill_addr>__<decode_addr>"``, between every ready prefill group and
  every ready decode group, and activates each pair whose two groups are ready;
- every pass (registration, heartbeat, the timeout sweep) deactivates a pair with a group that is not ready and
  clears its channel metadata (the comm id and the device list) — except that a heartbeat from a prefill rank 0
  leaves the metadata of its own group's pairs while only its own group is not ready (KsanaLLM's exception: rank 0
  keeps the comm id it registered while its other ranks come up);
- a prefill rank 0 that registers (a new process) clears and deactivates its pairs: its old comm id is void.

Each method takes a SQLAlchemy session and runs inside one transaction (``Storage.run``); errors are ``APIError``s
with KsanaLLM's status codes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import attrs
from sqlalchemy import select
from sqlalchemy.orm import Session

from ksana.router.protocol import RegisterCommIdRequest, RegisterNodeRequest, comm_key, split_comm_key
from ksana.router.storage import CommGroupPair, InferenceGroupStatus, NodeInfo
from ksana.server.protocol import APIError

GroupKey = tuple[str, str]  # (inference_addr, role)


def to_datetime(seconds: float) -> datetime:
    """Epoch seconds as the naive UTC datetime the tables hold."""
    return datetime.fromtimestamp(seconds, UTC).replace(tzinfo=None)


def to_seconds(stamp: datetime) -> float:
    return stamp.replace(tzinfo=UTC).timestamp()


def iso(stamp: datetime) -> str:
    return stamp.replace(tzinfo=UTC).isoformat()


@attrs.frozen
class Route:
    """An active pair as the proxy sees it: usable until ``online_until`` (epoch seconds), when the older of its two
    rank-0 heartbeats times out."""

    comm_key: str
    prefill_addr: str
    decode_addr: str
    online_until: float


@attrs.frozen
class Registry:
    cluster_name: str
    heartbeat_timeout_s: float
    clock: Callable[[], float] = time.time

    # ---- the three node routes ------------------------------------------------------------------------------------
    def register_node(self, session: Session, req: RegisterNodeRequest) -> dict[str, Any]:
        """A node joins (or rejoins) the cluster; the answer of ``201 Created``."""
        if req.cluster_name != self.cluster_name:
            raise APIError(400, f"cluster_name {req.cluster_name!r} is not this router's cluster "
                                f"{self.cluster_name!r}", param="cluster_name", code="wrong_cluster")
        if not req.devices:
            raise APIError(400, "devices: at least one device is required", param="devices", code="missing_devices")
        if req.world_size < len(req.devices):
            raise APIError(400, f"world_size {req.world_size} is below the node's {len(req.devices)} devices",
                           param="world_size", code="invalid_world_size")
        now = self._now()
        replaced = self._rows_replaced_by(session, req)
        node = replaced[0] if replaced else None
        for stale in replaced[1:]:  # rows another process held at this node's rank or coordinator address
            session.delete(stale)
        session.flush()
        if node is None:
            node = NodeInfo(node_id=req.node_id or uuid.uuid4().hex, created_at=now)
            session.add(node)
        elif req.node_id:
            node.node_id = req.node_id
        node.cluster_name = req.cluster_name
        node.inference_addr = req.inference_addr
        node.coordinator_addr = req.coordinator_addr
        node.role = req.group_role
        node.node_rank = req.node_rank
        node.world_size = req.world_size
        node.device_num = len(req.devices)
        node.devices = [device.model_dump() for device in req.devices]
        node.hostname = req.hostname
        node.job_id = req.job_id
        node.start_time = None if req.start_time is None else str(req.start_time)
        node.comm_id = req.comm_id
        node.last_heartbeat = now
        node.is_online = True
        node.updated_at = now
        session.flush()
        if node.role == "prefill" and node.node_rank == 0:
            for pair in self._pairs(session, prefill_addr=node.inference_addr):
                _clear(pair, now)
        groups = self._refresh_groups(session, now)
        self._deactivate_unready(session, groups, now, caller=node)
        return {"node_id": node.node_id, "is_online": True, "last_heartbeat": iso(now)}

    def heartbeat(self, session: Session, node_id: str) -> dict[str, Any]:
        """A node is alive; the answer tells it its group's readiness and the pairs (with comm ids) it is in."""
        node = self._node(session, node_id)
        now = self._now()
        node.last_heartbeat = now
        node.is_online = True
        node.updated_at = now
        session.flush()
        groups = self._refresh_groups(session, now)
        self._deactivate_unready(session, groups, now, caller=node)
        self._pair_ready_groups(session, groups, now)
        own = _group_key(node)
        nodes = self._nodes(session)
        addresses, ids = {}, {}
        for pair in self._pairs(session, **{f"{node.role}_addr": node.inference_addr}):
            if pair.is_active:
                addresses[pair.comm_key] = _channel_meta(nodes, pair)
                ids[pair.comm_key] = pair.data_channel_meta or ""
        return {
            "node_id": node.node_id,
            "is_online": True,
            "group_ready": groups[own].is_ready,
            "coordinator_addr": node.coordinator_addr,
            "node_role": node.role,
            "timestamp": iso(now),
            "comm_group_to_address": addresses,
            "comm_group_to_id": ids,
        }

    def register_comm_id(self, session: Session, req: RegisterCommIdRequest) -> dict[str, Any]:
        """Prefill rank 0 names the communicator of one of its pairs (KsanaLLM: a base64 NCCL unique id)."""
        node = self._node(session, req.node_id)
        if node.role != "prefill" or node.node_rank != 0:
            raise APIError(403, f"only a prefill node of rank 0 registers comm ids; node {node.node_id} is "
                                f"{node.role} rank {node.node_rank}", code="not_prefill_rank_0")
        addrs = split_comm_key(req.comm_key)
        if addrs is None:
            raise APIError(400, f"comm_key {req.comm_key!r} is not '<prefill_addr>__<decode_addr>'",
                           param="comm_key", code="invalid_comm_key")
        if addrs[0] != node.inference_addr:
            raise APIError(400, f"comm_key {req.comm_key!r} names prefill {addrs[0]!r}, not this node's "
                                f"{node.inference_addr!r}", param="comm_key", code="invalid_comm_key")
        pair = session.scalars(select(CommGroupPair).where(CommGroupPair.cluster_name == self.cluster_name,
                                                           CommGroupPair.comm_key == req.comm_key)).first()
        if pair is None:
            raise APIError(400, f"comm_key {req.comm_key!r} is no pair of this cluster (a heartbeat pairs groups "
                                "once both are ready)", param="comm_key", code="invalid_comm_key")
        now = self._now()
        pair.data_channel_meta = req.comm_id
        pair.control_channel_meta = _channel_meta(self._nodes(session), pair)
        pair.updated_at = now
        return {"status": "OK", "comm_id": req.comm_id}

    # ---- what the router itself asks ------------------------------------------------------------------------------
    def sweep(self, session: Session) -> bool:
        """Mark nodes whose heartbeat timed out offline, their groups not ready and their pairs inactive; true
        when anything changed (a quiet cluster costs a read, not a write)."""
        now = self._now()
        cutoff = now - self._timeout
        stale = [node for node in self._nodes(session) if node.is_online and node.last_heartbeat < cutoff]
        if not stale:
            return False
        groups = self._refresh_groups(session, now)
        self._deactivate_unready(session, groups, now, caller=None)
        return True

    def routes(self, session: Session) -> list[Route]:
        """The active pairs with the time until which both rank-0 nodes count as online."""
        rank0 = {_group_key(node): node for node in self._nodes(session) if node.node_rank == 0}
        routes = []
        for pair in self._pairs(session):
            prefill, decode = rank0.get((pair.prefill_addr, "prefill")), rank0.get((pair.decode_addr, "decode"))
            if not pair.is_active or prefill is None or decode is None:
                continue
            online_until = 0.0
            if prefill.is_online and decode.is_online:
                online_until = min(to_seconds(prefill.last_heartbeat), to_seconds(decode.last_heartbeat))
                online_until += self.heartbeat_timeout_s
            routes.append(Route(pair.comm_key, pair.prefill_addr, pair.decode_addr, online_until))
        return routes

    def nodes(self, session: Session) -> dict[str, Any]:
        """``GET /nodes``: every node as registered, whether it is online, its group's readiness and its pairs."""
        now = self._now()
        groups = {(g.inference_addr, g.role): g for g in session.scalars(
            select(InferenceGroupStatus).where(InferenceGroupStatus.cluster_name == self.cluster_name))}
        pairs = self._pairs(session)
        nodes = self._nodes(session)
        out = []
        for node in sorted(nodes, key=lambda n: (n.role, n.inference_addr, n.node_rank)):
            group = groups.get(_group_key(node))
            mine = [p for p in pairs if getattr(p, f"{node.role}_addr") == node.inference_addr]
            out.append({
                "node_id": node.node_id,
                "cluster_name": node.cluster_name,
                "inference_addr": node.inference_addr,
                "coordinator_addr": node.coordinator_addr,
                "group_role": node.role,
                "node_rank": node.node_rank,
                "world_size": node.world_size,
                "device_num": node.device_num,
                "devices": node.devices,
                "hostname": node.hostname,
                "job_id": node.job_id,
                "start_time": node.start_time,
                "comm_id": node.comm_id,
                "created_at": iso(node.created_at),
                "last_heartbeat": iso(node.last_heartbeat),
                "is_online": self._is_online(node, now),
                "group_ready": bool(group and group.is_ready),
                "pairs": [{"comm_key": p.comm_key, "is_active": p.is_active} for p in mine],
            })
        return {
            "cluster_name": self.cluster_name,
            "heartbeat_timeout": self.heartbeat_timeout_s,
            "nodes": out,
            "pairs": [{"comm_key": p.comm_key, "prefill_addr": p.prefill_addr, "decode_addr": p.decode_addr,
                       "is_active": p.is_active, "comm_id": p.data_channel_meta,
                       "control_channel_meta": p.control_channel_meta} for p in pairs],
        }

    # ---- the rules ------------------------------------------------------------------------------------------------
    def _refresh_groups(self, session: Session, now: datetime) -> dict[GroupKey, InferenceGroupStatus]:
        """Mark timed-out nodes offline, then recompute every group's device sum and readiness."""
        nodes = self._nodes(session)
        cutoff = now - self._timeout
        for node in nodes:
            if node.is_online and node.last_heartbeat < cutoff:
                node.is_online = False
                node.updated_at = now
        groups = {(g.inference_addr, g.role): g for g in session.scalars(
            select(InferenceGroupStatus).where(InferenceGroupStatus.cluster_name == self.cluster_name))}
        members: dict[GroupKey, list[NodeInfo]] = {key: [] for key in groups}
        for node in nodes:
            members.setdefault(_group_key(node), []).append(node)
        for key, group_nodes in members.items():
            group = groups.get(key)
            if group is None:
                group = groups[key] = InferenceGroupStatus(cluster_name=self.cluster_name, inference_addr=key[0],
                                                           role=key[1])
                session.add(group)
            online = [node for node in group_nodes if node.is_online]
            group.world_size_expected = max((node.world_size for node in group_nodes), default=0)
            group.online_device_sum = sum(node.device_num for node in online)
            group.online_node_count = len(online)
            group.is_ready = bool(online) and group.online_device_sum == group.world_size_expected
            group.last_computed_at = now
        session.flush()
        return groups

    def _deactivate_unready(self, session: Session, groups: dict[GroupKey, InferenceGroupStatus], now: datetime,
                            caller: NodeInfo | None) -> None:
        caller_is_prefill_rank0 = caller is not None and caller.role == "prefill" and caller.node_rank == 0
        for pair in self._pairs(session):
            prefill_ready = _ready(groups, pair.prefill_addr, "prefill")
            decode_ready = _ready(groups, pair.decode_addr, "decode")
            if prefill_ready and decode_ready:
                continue
            keeps_meta = (decode_ready and caller_is_prefill_rank0 and caller.inference_addr == pair.prefill_addr)
            if keeps_meta:
                if pair.is_active:
                    pair.is_active = False
                    pair.updated_at = now
            else:
                _clear(pair, now)

    def _pair_ready_groups(self, session: Session, groups: dict[GroupKey, InferenceGroupStatus],
                           now: datetime) -> None:
        pairs = {pair.comm_key: pair for pair in self._pairs(session)}
        prefills = [addr for (addr, role), g in groups.items() if role == "prefill" and g.is_ready]
        decodes = [addr for (addr, role), g in groups.items() if role == "decode" and g.is_ready]
        for prefill_addr in prefills:
            for decode_addr in decodes:
                key = comm_key(prefill_addr, decode_addr)
                pair = pairs.get(key)
                if pair is None:
                    pair = CommGroupPair(comm_key=key, cluster_name=self.cluster_name, prefill_addr=prefill_addr,
                                         decode_addr=decode_addr, is_active=False, updated_at=now)
                    session.add(pair)
                if not pair.is_active:
                    pair.is_active = True
                    pair.updated_at = now
        session.flush()

    # ---- lookups --------------------------------------------------------------------------------------------------
    def _now(self) -> datetime:
        return to_datetime(self.clock())

    @property
    def _timeout(self) -> timedelta:
        return timedelta(seconds=self.heartbeat_timeout_s)

    def _is_online(self, node: NodeInfo, now: datetime) -> bool:
        return node.is_online and node.last_heartbeat >= now - self._timeout

    def _node(self, session: Session, node_id: str) -> NodeInfo:
        node = session.scalars(select(NodeInfo).where(NodeInfo.node_id == node_id,
                                                      NodeInfo.cluster_name == self.cluster_name)).first()
        if node is None:
            raise APIError(404, f"node {node_id!r} is not registered (register it with /RegisterNode)",
                           param="node_id", code="unknown_node")
        return node

    def _nodes(self, session: Session) -> list[NodeInfo]:
        return list(session.scalars(select(NodeInfo).where(NodeInfo.cluster_name == self.cluster_name)))

    def _pairs(self, session: Session, **where: str) -> list[CommGroupPair]:
        query = select(CommGroupPair).where(CommGroupPair.cluster_name == self.cluster_name)
        for column, value in where.items():
            query = query.where(getattr(CommGroupPair, column) == value)
        return list(session.scalars(query.order_by(CommGroupPair.comm_key)))

    def _rows_replaced_by(self, session: Session, req: RegisterNodeRequest) -> list[NodeInfo]:
        """Rows this registration takes over: the same ``node_id``, the same (address, role, rank), or the same
        coordinator address; the first is updated in place, the others are gone."""
        found: list[NodeInfo] = []

        def add(rows: Iterable[NodeInfo]) -> None:
            found.extend(row for row in rows if row not in found)

        if req.node_id:
            add(session.scalars(select(NodeInfo).where(NodeInfo.node_id == req.node_id)))
        add(session.scalars(select(NodeInfo).where(
            NodeInfo.cluster_name == req.cluster_name, NodeInfo.inference_addr == req.inference_addr,
            NodeInfo.role == req.group_role, NodeInfo.node_rank == req.node_rank)))
        if req.coordinator_addr:
            add(session.scalars(select(NodeInfo).where(NodeInfo.cluster_name == req.cluster_name,
                                                       NodeInfo.coordinator_addr == req.coordinator_addr)))
        return found


def _group_key(node: NodeInfo) -> GroupKey:
    return node.inference_addr, node.role


def _ready(groups: dict[GroupKey, InferenceGroupStatus], addr: str, role: str) -> bool:
    group = groups.get((addr, role))
    return bool(group and group.is_ready)


def _clear(pair: CommGroupPair, now: datetime) -> None:
    if pair.is_active or pair.data_channel_meta is not None or pair.control_channel_meta is not None:
        pair.is_active = False
        pair.data_channel_meta = None
        pair.control_channel_meta = None
        pair.updated_at = now


def _channel_meta(nodes: list[NodeInfo], pair: CommGroupPair) -> list[list[Any]]:
    """``[[node_rank, device_id, coordinator_addr], ...]``: the prefill group's online devices by rank, then the
    decode group's (KsanaLLM's ``comm_group_to_address`` order, which the pair's communicator ranks follow)."""
    meta = []
    for addr, role in ((pair.prefill_addr, "prefill"), (pair.decode_addr, "decode")):
        group = sorted((n for n in nodes if n.inference_addr == addr and n.role == role and n.is_online),
                       key=lambda n: n.node_rank)
        meta += [[node.node_rank, device["device_id"], node.coordinator_addr] for node in group
                 for device in node.devices]
    return meta
