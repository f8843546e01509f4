"""Your model, your data, end to end on the Ray cluster: a folder of .jsonl files and a tokenizer.json
become a dataset (`goodput tokenize`), a Llama-3-shaped model trains on it on dp2 x pp2 with a
learning-rate schedule and clipping, survives a kill-node drill (healed from peers), and its
checkpoint leaves as a Hugging Face folder (`goodput export`) on which `goodput eval` gives the loss
transformers' LlamaForCausalLM gives on the same windows (1e-4 relative: the independent reference).
And a model of one's own (examples/gpt2_provider.py, through trainer/provider.py's contract) does
the same on the cluster: trains on dp2 x pp2, heals a kill-node from peers, ends where the same run
without the drill ends."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from controller.ray.cluster import LocalRayCluster
from controller.ray.runner import drive
from controller.run_state import RunState
from controller.spec import load_spec

pytestmark = pytest.mark.cluster

WORDS = ("node", "rank", "step", "loss", "shard", "peer", "drill", "spare", "mesh", "token", "heal", "store")


def bring_back_nodes(cluster: LocalRayCluster) -> None:
    """Start again the fixture cluster's nodes a kill-node drill ended."""
    for n in range(5):
        if f"node-{n}" not in cluster._nodes:  # noqa: SLF001 - the test owns the fixture cluster
            cluster.add_node(n)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    from controller.cli.main import build_parser

    opts = build_parser().parse_args(list(argv))
    assert opts.func(opts) == 0
    return capsys.readouterr().out


def test_text_to_trained_model_to_hugging_face_and_back(ray_cluster: LocalRayCluster, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    import random

    from tests.support.text import train_tokenizer
    from transformers import LlamaForCausalLM

    from trainer.export import text_windows

    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 80))) + "." for _ in range(300)]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for part in range(3):
        (corpus / f"part{part}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[part::3]))
    train_tokenizer(docs, tmp_path / "tokenizer.json")

    # 1. goodput tokenize
    data = f"file://{tmp_path / 'data'}"
    _cli(capsys, "tokenize", "--tokenizer", str(tmp_path / "tokenizer.json"), "--out", data,
         *map(str, sorted(corpus.glob("*.jsonl"))))
    # 2. the run: a Llama-3-shaped model (GQA, scaled RoPE) on that text, a drill in the middle
    spec_path = tmp_path / "mytext.yaml"
    spec_path.write_text(yaml.safe_dump({
        "name": "mytext",
        "model": {"preset": "llama3-tiny", "n_layers": 4},
        "data": {"kind": "shards", "uri": data},
        "train": {"steps": 14, "global_batch": 8, "micro_batch": 2, "lr": 1e-2, "warmup_steps": 3,
                  "decay": "cosine", "min_lr_ratio": 0.1, "grad_clip": 1.0},
        "parallelism": {"dp": 2, "pp": 2, "tp": 1},
        "cluster": {"local": {"nodes": 5, "gpus_per_node": 2, "racks": 2, "spares": 0}},
        "checkpoint": {"uri": f"file://{tmp_path / 'ckpt'}", "every_steps": 7, "keep": 3, "peer_every_steps": 1},
        "health": {"collective_timeout_s": 6, "hang_floor_s": 10},
        "drills": [{"kind": "kill-node", "at_step": 6}],
    }))
    spec = load_spec(spec_path)
    try:
        c = drive(spec, ray_cluster)
    finally:
        bring_back_nodes(ray_cluster)
    assert c.state is RunState.SUCCEEDED, c.error
    (drill,) = c.to_dict(0)["drills"]
    assert drill["outcome"] == "recovered" and drill["restored_from"] == "peer", drill
    history = c.progress.history
    assert [h["step"] for h in history] == list(range(1, 15))
    assert history[-1]["loss"] < history[0]["loss"] - 1.0, "it learns the text"
    # 3. goodput export, read by transformers
    _cli(capsys, "export", str(spec_path), "--hf", str(tmp_path / "hf"), "--dtype", "float32")
    theirs = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    # 4. goodput eval on held-out text, against transformers on the same windows
    held_out = " ".join(rng.choice(WORDS) for _ in range(600))
    (tmp_path / "held_out.txt").write_text(held_out)
    result = json.loads(_cli(capsys, "eval", str(spec_path), "--text", str(tmp_path / "held_out.txt"), "--json"))
    windows = text_windows(held_out, tmp_path / "tokenizer.json", spec.to_model_config().seq_len)
    with torch.no_grad():
        logits = theirs(input_ids=windows[:, :-1]).logits
        reference = float(F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()))
    assert result["step"] == 14 and result["windows"] == len(windows)
    assert abs(result["loss"] - reference) <= 1e-4 * reference, (result, reference)
    assert result["loss"] < history[0]["loss"] - 1.0, "the exported model knows the text"


def test_a_model_of_your_own_trains_and_heals_on_the_cluster(ray_cluster: LocalRayCluster, tmp_path: Path) -> None:
    from controller.providers import with_model_numbers
    from controller.spec import parse_spec
    from tests.dist.harness import run_ranks
    from tests.dist.reshard import load_on_mesh
    from trainer.config import MeshShape, config_to_dict

    def spec(name: str, drills: list[dict]) -> dict:
        return {
            "name": name,
            "model": {"provider": "examples.gpt2_provider:build", "args": {"n_layers": 2, "d_model": 64, "n_heads": 4},
                      "vocab_size": 64, "seq_len": 32},
            "data": {"kind": "synthetic", "seed": 0},
            "train": {"steps": 10, "global_batch": 8, "micro_batch": 2, "lr": 1e-2},
            "parallelism": {"dp": 2, "pp": 2, "tp": 1},
            "cluster": {"local": {"nodes": 5, "gpus_per_node": 2, "racks": 2, "spares": 1}},
            "checkpoint": {"uri": f"file://{tmp_path}", "every_steps": 5, "keep": 3, "peer_every_steps": 1},
            "health": {"collective_timeout_s": 6, "hang_floor_s": 10},
            "drills": drills,
        }

    try:
        c = drive(parse_spec(spec("mine", [{"kind": "kill-node", "at_step": 4}])), ray_cluster)
    finally:
        bring_back_nodes(ray_cluster)
    assert c.state is RunState.SUCCEEDED, c.error
    (drill,) = c.to_dict(0)["drills"]
    assert drill["outcome"] == "recovered" and drill["restored_from"] == "peer", drill
    planned = c.events.of_kind("planned")[0].detail
    assert planned["memory_per_gpu_bytes"] > 0  # planned with the provider's own numbers
    straight = drive(parse_spec(spec("straight", [])), ray_cluster)
    assert straight.state is RunState.SUCCEEDED, straight.error
    one_process = config_to_dict(with_model_numbers(parse_spec(spec("straight", []))).trainer_config(MeshShape()))

    def final(run_id: str) -> dict[str, torch.Tensor]:  # the step-10 checkpoint reassembled on one process
        (loaded,) = run_ranks(load_on_mesh, 1, config=one_process, uri=f"file://{tmp_path}", step=10, run_id=run_id)
        return loaded["state"]

    mine, reference = final("mine"), final("straight")
    assert set(mine) == set(reference) and any(k.endswith("attn.q.bias") for k in mine)
    for key, value in reference.items():
        assert torch.equal(mine[key], value), f"{key} differs from the run without the drill"


def test_a_provider_that_raises_at_step_5_ends_the_run_as_a_user_error_after_one_retry(
        ray_cluster: LocalRayCluster, tmp_path: Path) -> None:
    """The user's own code raising (tests/support/raising_provider.py: its loss raises at step 5 on every
    rank) is not the cluster's fault: one retry with the raising nodes' ranks moved elsewhere, then the
    run fails `user_error` with the provider's traceback, and elastic.max_failures is untouched."""
    from controller.spec import parse_spec

    raw = {
        "name": "buggy",
        "model": {"provider": "tests.support.raising_provider:build", "vocab_size": 64, "seq_len": 32,
                  "args": {"n_layers": 2, "d_model": 32, "n_heads": 4, "raise_at_step": 5, "micro_batches": 2}},
        "data": {"kind": "synthetic", "seed": 0},
        "train": {"steps": 20, "global_batch": 8, "micro_batch": 2, "lr": 1e-2},
        "parallelism": {"dp": 2, "pp": 1, "tp": 1},
        "cluster": {"local": {"nodes": 5, "gpus_per_node": 2, "racks": 2, "spares": 1}},
        "checkpoint": {"uri": f"file://{tmp_path}", "every_steps": 100, "keep": 3, "peer_every_steps": 0},
        "health": {"collective_timeout_s": 6, "hang_floor_s": 10, "probes": False},
        "elastic": {"max_failures": 3},
        "drills": [],
    }
    c = drive(parse_spec(raw), ray_cluster)
    assert c.state is RunState.FAILED and c.error is not None and c.error.code == "user_error", c.error
    assert "step 5" in c.error.message and "operands could not be broadcast together" in c.error.message
    assert c.error.traceback and "raising_provider.py" in c.error.traceback, c.error.traceback
    decisions = [e.detail["code"] for e in c.events.of_kind("decision")]
    assert decisions == ["retried_elsewhere"], decisions
    assert len(c.events.of_kind("attempt_started")) == 2, "one retry"
    view = c.to_dict(0)
    assert c.failures == [] and view["budgets"]["infrastructure"]["used"] == 0, "max_failures untouched"
    assert view["error"]["traceback"] == c.error.traceback
