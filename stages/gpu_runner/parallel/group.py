"""Tensor parallelism's process group: joining and leaving it, this rank's place in it, the collectives,
and the plan broadcast.

The group rides on torch.distributed: gloo on CPU, NCCL on CUDA (one device per rank). The logits
are gathered on rank 0, which alone samples; its tokens reach the other ranks by a broadcast.
Plans reach ranks that read no plan ring by a broadcast over a gloo group (`PlanBroadcast`).
How the model is cut between the ranks is sharding.py.
"""
from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

JOIN_POLL_S = 0.05


class RankJoinError(RuntimeError):
    """A rank did not join the process group in time: the message names the rank and the address."""


class PeerLostError(RuntimeError):
    """A collective failed because another rank left the group: the message names this rank and the address."""


# What a collective's error says when a peer went (gloo: a closed or reset connection, a
# timeout; NCCL: its remote-error and abort reports).
PEER_LOST_WORDS = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "timed out")


@contextmanager
def naming_lost_peers(tp: TensorParallel | None, master_addr: str, master_port: int) -> Iterator[None]:
    """Turns a collective's failure into a PeerLostError naming this rank and the group's
    address (the backend's own words kept after them); other errors pass unchanged."""
    try:
        yield
    except RuntimeError as exc:
        text = str(exc)
        if tp is None or isinstance(exc, (PeerLostError, RankJoinError)) \
                or not any(word in text.lower() for word in PEER_LOST_WORDS):
            raise
        raise PeerLostError(f"tensor-parallel rank {tp.rank} of {tp.size}: a peer rank left the group at "
                            f"{master_addr}:{master_port} ({text.splitlines()[0] if text else type(exc).__name__})") from exc


@dataclass(slots=True)
class TensorParallel:
    """This rank's place in the group. `group` carries the model's collectives on the model's
    device; `cpu_group` (gloo) carries host values such as plans and block counts."""

    rank: int
    size: int
    group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup | None
    local_rank: int = 0  # the rank's place on its machine: its CUDA device
    # Rank 0 and the ranks that read no plan ring: the plans' broadcast group (None: every rank reads a ring).
    plan_group: dist.ProcessGroup | None = None

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and publishes the step's tokens."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's [n, vocab shard] logits -> the whole [n, vocab] on rank 0, None elsewhere."""
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.is_driver else None
        dist.gather(local, parts, dst=0, group=self.group)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def broadcast_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rank 0's sampled ids onto every rank, on the device (others pass a tensor of the same shape)."""
        dist.broadcast(token_ids, src=0, group=self.group)
        return token_ids

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV blocks each rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


def use_local_device(device_type: str, local_rank: int, ranks_per_node: int) -> None:
    """Make rank `local_rank` of this machine use its own device: `cuda:{local_rank}` (NCCL takes
    the current device), or on the CPU its share of the cores (ranks using every core each would
    fight over them)."""
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_per_node))


def join_group(rank: int, size: int, master_addr: str, master_port: int, device_type: str,
               timeout_s: float, *, local_rank: int = 0, num_ring_readers: int = 1,
               check: Callable[[], None] | None = None, published: dict[str, str] | None = None,
               ranks_per_node: int | None = None) -> TensorParallel:
    """Join the `size`-rank group through torch.distributed's TCP rendezvous at master_addr:port.
    Ranks 0 .. num_ring_readers - 1 read their plans from the plan ring; the others get them by a
    broadcast from rank 0 (`plan_group`). RankJoinError naming the missing ranks and the address
    if any has not joined within timeout_s; rank 0 calls `check` while it waits (it raises when a
    rank is known to have died). Rank 0 puts `published` in the rendezvous store for whoever
    joins to read (`read_published`): the head's engine config, for the other machines."""
    address = f"{master_addr}:{master_port}"
    timeout = datetime.timedelta(seconds=timeout_s)
    use_local_device(device_type, local_rank, size if ranks_per_node is None else ranks_per_node)
    try:
        store = dist.TCPStore(master_addr, master_port, size, is_master=rank == 0, timeout=timeout,
                              wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise RankJoinError(f"tensor-parallel rank {rank} could not reach the rendezvous at {address}: {exc}") from exc
    if rank == 0:
        for key, value in (published or {}).items():
            store.set(key, value)
    store.set(f"joined/{rank}", "1")
    if rank == 0:
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [r for r in range(size) if not store.check([f"joined/{r}"])]
            if not missing:
                break
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise RankJoinError(f"tensor-parallel rank{'s' if len(missing) > 1 else ''} "
                                    f"{', '.join(map(str, missing))} did not join the group at {address} "
                                    f"within {timeout_s:g} s")
            time.sleep(JOIN_POLL_S)  # start-up only
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    plan_ranks = [0, *range(num_ring_readers, size)]
    plan_group = None
    if len(plan_ranks) > 1:  # new_group is collective: every rank makes it, members or not
        plan_group = dist.new_group(plan_ranks, backend="gloo")
    member = rank in plan_ranks
    return TensorParallel(rank, size, dist.group.WORLD, cpu_group, local_rank,
                          plan_group if member else None)


def read_published(master_addr: str, master_port: int, key: str, timeout_s: float) -> str:
    """What rank 0 published under `key` in the rendezvous store at master_addr:port, waiting for it
    up to timeout_s (RankJoinError naming the address when nothing answers)."""
    address = f"{master_addr}:{master_port}"
    try:
        store = dist.TCPStore(master_addr, master_port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        return store.get(key).decode()
    except (RuntimeError, OSError) as exc:  # torch's DistStoreError is a RuntimeError
        raise RankJoinError(f"no rendezvous answered at {address} within {timeout_s:g} s: {exc}") from exc


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class PlanBroadcast:
    """Each step's encoded plan from rank 0 to ranks that read no plan ring (another node's, or
    the offline engine's workers), over a gloo group: a length, then the bytes. An empty plan
    (length 0) tells the receivers to stop."""

    def __init__(self, group: dist.ProcessGroup | None, src: int = 0) -> None:
        self.group = group
        self.src = src

    def send(self, parts: list[bytes]) -> None:
        payload = b"".join(parts)
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src=self.src, group=self.group)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=self.src, group=self.group)

    def stop(self) -> None:
        dist.broadcast(torch.zeros(1, dtype=torch.int64), src=self.src, group=self.group)

    def receive(self) -> memoryview | None:
        """The next plan's bytes, or None when rank 0 said stop."""
        length = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(length, src=self.src, group=self.group)
        num_bytes = int(length.item())
        if num_bytes == 0:
            return None
        payload = torch.empty(num_bytes, dtype=torch.uint8)
        dist.broadcast(payload, src=self.src, group=self.group)
        return memoryview(payload.numpy())

