"""`goodput export`: a committed checkpoint of a run as a Hugging Face Llama folder (trainer/hf.py).

The step (the newest that verifies, or the one asked for, verified first) is read from the store into
one process with DCP (no process group: its load plan reassembles every shard of every rank and mesh
into whole tensors), then written as safetensors + config.json.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from checkpointing.manifest import CheckpointError, check_identity, latest_verified, read_manifest, step_prefix, verify
from checkpointing.store import ObjectStore
from trainer.config import ModelConfig, state_fingerprint, state_identity


def whole_model(model: ModelConfig) -> tuple[Any, torch.nn.Module]:
    """The model's provider and its whole model as one stage (under the caller's device context)."""
    from trainer.provider import load_provider

    provider = load_provider(model)
    return provider, provider.build_stage(range(model.layers), first=True, last=True)


def load_full_model(store: ObjectStore, run_id: str, model: ModelConfig, step: int | None = None
                    ) -> tuple[int, dict[str, torch.Tensor]]:
    """(step, full parameters by goodput's names, float32) of a run's committed checkpoint; the
    newest verified one when `step` is None. CheckpointError says what is wrong."""
    import torch.distributed.checkpoint as dcp

    if step is None:
        found = latest_verified(store, run_id)
        if found is None:
            raise CheckpointError(f"no committed checkpoint of run {run_id!r} verifies under {store.uri}")
        manifest = found[0]
    else:
        manifest = read_manifest(store, run_id, step)
        verify(store, manifest)
    check_identity(manifest, state_fingerprint(model), state_identity(model), store.uri)
    with torch.device("meta"):
        shapes = {name: (p.shape, p.dtype) for name, p in whole_model(model)[1].named_parameters()}
    prefix = step_prefix(run_id, manifest.step)
    with tempfile.TemporaryDirectory(prefix="goodput-export-") as tmp:
        for rel in manifest.files:
            store.download(f"{prefix}/{rel}", Path(tmp) / rel)
        state = {"model": {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()}}
        dcp.load(state, storage_reader=dcp.FileSystemReader(tmp), no_dist=True)
    return manifest.step, {name: value.float() for name, value in state["model"].items()}


def export_hf(store: ObjectStore, run_id: str, model: ModelConfig, out: Path, *, step: int | None = None,
              dtype: str = "bfloat16") -> int:
    """Write the run's checkpoint as a Hugging Face folder at `out`; the step exported."""
    from trainer.hf import save_hf

    if model.provider is not None:
        raise ValueError(f"goodput export writes Hugging Face Llama folders of goodput's own decoder; model.provider "
                         f"{model.provider} has its own layout: read its checkpoint by parameter name "
                         "(trainer/export.py load_full_model), or goodput eval it")
    exported, state = load_full_model(store, run_id, model, step)
    save_hf(out, model, state, dtype=dtype)
    return exported


def text_windows(text: str, tokenizer_path: Path, seq_len: int) -> torch.Tensor:
    """The whole text tokenized (no end-of-sequence added), cut into non-overlapping windows of
    `seq_len` tokens, the last partial window dropped: (windows, seq_len) int64."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer_path)).encode(text, add_special_tokens=False).ids
    count = len(ids) // seq_len
    if count < 1:
        raise ValueError(f"the text is {len(ids)} tokens, fewer than one window of seq_len = {seq_len}")
    return torch.tensor(ids[:count * seq_len], dtype=torch.int64).view(count, seq_len)


@torch.no_grad()
def mean_loss(model: ModelConfig, state: dict[str, torch.Tensor], windows: torch.Tensor, *, batch: int = 8) -> float:
    """Mean next-token loss (the model's own: cross-entropy for goodput's decoder) over every predicted
    token of every window (seq_len - 1 each)."""
    provider, net = whole_model(model)
    net.load_state_dict(state)
    net.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows), batch):
        rows = windows[start:start + batch]
        predicted = rows[:, 1:].numel()
        total += float(provider.loss(net(rows[:, :-1]).float(), rows[:, 1:])) * predicted  # a mean: weigh it
        count += predicted
    return total / count
