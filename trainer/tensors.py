"""What one rank holds of a tensor, read exactly: its local shard (a DTensor's, or the tensor itself)
and a checksum of its raw bits. Probes, replica checksums and the optimizer's gradient norm use them."""

from __future__ import annotations

from typing import Iterator

import torch

INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
            torch.float16: torch.int16}
"""The integer dtype of each float dtype's width: its bits read as a number."""


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    to_local = getattr(p, "to_local", None)
    return to_local() if to_local is not None else p


def bits_checksum(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> int:
    """Exact checksum of the raw bits: any single flipped bit changes it. Summed on the tensors'
    device and read once (one sync on a GPU, not one per parameter)."""
    total: torch.Tensor | None = None
    for t in tensors:
        if t.numel() == 0:
            continue
        flat = t.detach().contiguous().view(-1)
        part = flat.view(INT_VIEW[flat.dtype]).sum(dtype=torch.int64)
        total = part if total is None else total + part
    return 0 if total is None else int(total.item()) & 0x7FFF_FFFF_FFFF_FFFF
