"""Point-to-point delivery of loaded bytes: each item one rank read goes to the other ranks that need it."""

from __future__ import annotations

from typing import Any, Hashable, TypeVar

import torch
import torch.distributed as dist

K = TypeVar("K", bound=Hashable)


def exchange(routes: dict[K, tuple[int, tuple[int, ...]]], held: dict[K, bytes], me: int,
             group: Any = None) -> dict[K, bytes]:
    """Collective over `group` (default: the default group; its ranks are the default group's).
    `routes`: item (a key ending with its length in bytes) -> (the rank that read it, the ranks that
    need it), the same on every rank; `held`: the items this rank read. Sends what this rank read to
    the others that need it and receives what it needs from their readers (point to point, in one
    order on every rank); every item this rank read or needs, with its bytes. Over NCCL the bytes
    cross in GPU memory; a gloo group keeps them in host memory."""
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
              else torch.device("cpu"))
    ops: list[dist.P2POp] = []
    inbox: dict[K, torch.Tensor] = {}
    for item in sorted(routes):  # type: ignore[type-var]
        owner, readers = routes[item]
        if owner == me:
            if any(peer != me for peer in readers):
                buf = torch.frombuffer(bytearray(held[item]), dtype=torch.uint8).to(device)
                ops += [dist.P2POp(dist.isend, buf, peer, group=group) for peer in readers if peer != me]
        elif me in readers:
            inbox[item] = torch.empty(int(item[-1]), dtype=torch.uint8, device=device)  # type: ignore[index]
            ops.append(dist.P2POp(dist.irecv, inbox[item], owner, group=group))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    out = dict(held)
    out.update({item: buf.cpu().numpy().tobytes() for item, buf in inbox.items()})
    return out

