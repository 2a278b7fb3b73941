"""The collectives a model's share takes part in (torch.distributed). The single-worker
layout needs no process group: its collectives are identities, so the model code is the same
with or without parallelism."""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from engine_svc.distributed.layout import ParallelLayout


class Collectives:
    """The collectives the model calls. Over one worker they do nothing."""

    def __init__(self, layout: ParallelLayout, tp_group: Any = None) -> None:
        self.layout = layout
        self.tp_group = tp_group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the tensor-parallel group, in place."""
        if self.layout.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` side by side along the last dimension, in rank order."""
        if self.layout.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.layout.tp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def send_to_next_stage(self, x: torch.Tensor) -> None:
        dist.send(x.contiguous(), self.layout.next_stage_rank())

    def recv_from_previous_stage(self, x: torch.Tensor) -> torch.Tensor:
        dist.recv(x, self.layout.previous_stage_rank())
        return x


SINGLE = Collectives(ParallelLayout())


# How long a rank waits for the rendezvous store and for the other ranks there.
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)


def _host(master_addr: str) -> str:
    """The address a socket takes: an IPv6 literal may come bracketed, as in a URL."""
    return master_addr.strip("[]")


def host_rendezvous(master_addr: str, world_size: int) -> dist.TCPStore:
    """The ranks' rendezvous store, served by the caller at master_addr on a port the kernel
    picks (its `.port`). The caller binds the socket and hands it over, so the port stays
    bound from here on (a port found free, closed and handed to rank 0 could be taken in
    between) and the store listens on master_addr alone (TCPStore binding its own port
    listens on every interface). The store closes the socket when it is collected."""
    host = _host(master_addr)
    family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    listener = socket.create_server(address[:2], family=family)
    port = listener.getsockname()[1]
    fd = listener.detach()
    try:
        return dist.TCPStore(
            host,
            port,
            world_size,
            is_master=True,
            timeout=RENDEZVOUS_TIMEOUT,
            wait_for_workers=False,
            master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise


def init_distributed(
    layout: ParallelLayout,
    master_addr: str,
    master_port: int,
    backend: str,
    rendezvous_hosted: bool = False,
) -> Collectives:
    """Join the process group of every rank, then build each stage's tensor-parallel group
    (every rank creates every group, in the same order, as torch.distributed requires).
    With `rendezvous_hosted`, the store at master_addr:master_port is already served
    (host_rendezvous) and every rank is its client; else rank 0 serves it."""
    if rendezvous_hosted:
        store = dist.TCPStore(
            _host(master_addr),
            master_port,
            layout.world_size,
            is_master=False,
            timeout=RENDEZVOUS_TIMEOUT,
        )
        dist.init_process_group(
            backend, store=store, rank=layout.rank, world_size=layout.world_size
        )
    else:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=layout.rank,
            world_size=layout.world_size,
        )
    tp_group = None
    for stage in range(layout.pp_size):
        ranks = list(range(stage * layout.tp_size, (stage + 1) * layout.tp_size))
        group = dist.new_group(ranks)
        if stage == layout.pp_rank:
            tp_group = group
    return Collectives(layout, tp_group)
