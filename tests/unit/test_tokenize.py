"""`goodput tokenize` and `data.kind: shards`: text files to uint32 shards and back, samples that are a
pure function of (seed, sample id), mixtures by weight, and the errors that say what to fix.
References: the tokenizer's own encoding of each document and its decode back to the text; the plain
concatenated stream for every window; a tokenizer trained here (nothing downloaded)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.support.text import EOS, train_tokenizer
from trainer.shards import ShardSource, TokenDataset
from trainer.tokenize import TokenizeError, tokenize

ROOT = Path(__file__).resolve().parents[2]

TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Fault tolerance keeps long training runs going when nodes die.",
    "A tokenizer turns text into ids; the model predicts the next one.",
    "Grüße aus Köln — unicode survives the round trip.",
    "Short.",
    "Checkpoints are either whole and verified or not visible.",
    "Peer snapshots live in host memory on two nodes.",
]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(TEXTS * 20, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def _files(root: Path) -> list[Path]:
    """TEXTS[0:2] as .txt files, TEXTS[2:5] as .jsonl rows (field body), TEXTS[5:7] in a parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(2):
        (path := root / f"doc{i}.txt").write_text(TEXTS[i], encoding="utf-8")
        out.append(path)
    (path := root / "rows.jsonl").write_text("".join(json.dumps({"body": t, "id": i}) + "\n"
                                                     for i, t in enumerate(TEXTS[2:5])), encoding="utf-8")
    out.append(path)
    pq.write_table(pa.table({"body": TEXTS[5:7] + [None]}), path := root / "more.parquet")
    out.append(path)
    return out


def test_files_become_shards_that_decode_back_to_the_documents(tmp_path: Path, tokenizer_file: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    eos = tok.token_to_id(EOS)
    out = tmp_path / "ds"
    manifest = tokenize(_files(tmp_path / "in"), tokenizer_file, f"file://{out}", field_name="body", shard_tokens=40)
    expected = [tok.encode(t, add_special_tokens=False).ids + [eos] for t in TEXTS]
    assert manifest.documents == len(TEXTS) and manifest.tokens == sum(map(len, expected))
    assert len(manifest.shards) > 1, "small shards: documents spread over several"
    assert manifest.tokenizer["vocab_size"] == tok.get_vocab_size() and manifest.tokenizer["eos_id"] == eos
    stream, documents = [], []
    for shard in manifest.shards:
        data = (out / shard["key"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]
        ids = np.frombuffer(data, dtype="<u4").tolist()
        starts = np.fromfile(out / shard["key"].replace(".bin", ".idx"), dtype="<u8").tolist()
        assert len(starts) == shard["documents"]
        documents += [ids[a:b] for a, b in zip(starts, starts[1:] + [len(ids)])]
        stream += ids
    assert documents == expected, "each document, in order, its end-of-sequence id after it"
    assert [tok.decode(d[:-1]) for d in documents] == TEXTS
    assert stream == [i for d in expected for i in d]


def test_every_window_of_an_epoch_once_and_each_the_stream_s_tokens(tmp_path: Path, tokenizer_file: Path) -> None:
    out = tmp_path / "ds"
    tokenize(_files(tmp_path / "in"), tokenizer_file, f"file://{out}", field_name="body", shard_tokens=33)
    stream = np.concatenate([np.fromfile(p, dtype="<u4") for p in sorted(out.glob("shard-*.bin"))]).astype(np.int64)
    seq = 8
    source = ShardSource([(f"file://{out}", 1.0)], seed=5, seq_len=seq, vocab_size=300)
    n = (len(stream) - 1) // seq
    rows = source.batch(range(n))
    windows = {tuple(stream[w * seq:w * seq + seq + 1]) for w in range(n)}
    assert {tuple(r) for r in rows} == windows and len({tuple(r) for r in rows}) == n
    again = ShardSource([(f"file://{out}", 1.0)], seed=5, seq_len=seq, vocab_size=300)
    assert np.array_equal(again.batch([3, n + 2, 7]), source.batch([3, n + 2, 7])), "a pure function of the id"
    assert not np.array_equal(source.batch(range(n, 2 * n)), rows), "the next epoch is shuffled anew"


def test_datasets_mix_by_weight_deterministically(tmp_path: Path, tokenizer_file: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    tokenize(_files(tmp_path / "in"), tokenizer_file, f"file://{a}", field_name="body")
    (tmp_path / "other.txt").write_text("zzzz " * 200, encoding="utf-8")
    tokenize([tmp_path / "other.txt"], tokenizer_file, f"file://{b}")
    source = ShardSource([(f"file://{a}", 3.0), (f"file://{b}", 1.0)], seed=1, seq_len=8, vocab_size=300)
    picks = np.array([source.dataset_of(i) for i in range(4000)])
    assert abs((picks == 0).mean() - 0.75) < 0.03
    only_b = set(TokenDataset(f"file://{b}", seq_len=8).tokens(0, 1000).tolist())
    for i in np.flatnonzero(picks[:50] == 1):
        assert set(source.batch([int(i)])[0].tolist()) <= only_b


def test_what_cannot_be_tokenized_or_read_says_what_to_fix(tmp_path: Path, tokenizer_file: Path) -> None:
    files = _files(tmp_path / "in")
    out = f"file://{tmp_path / 'ds'}"
    with pytest.raises(TokenizeError, match=r"rows.jsonl:1: no string field 'text' \(use --field\)"):
        tokenize(files, tokenizer_file, out)
    (bad := tmp_path / "notes.md").write_text("x")
    with pytest.raises(TokenizeError, match="use .txt, .jsonl or .parquet"):
        tokenize([bad], tokenizer_file, out)
    with pytest.raises(TokenizeError, match="--eos 'nope' is not a token"):
        tokenize(files[:1], tokenizer_file, out, eos="nope")
    tokenize(files, tokenizer_file, out, field_name="body")
    with pytest.raises(TokenizeError, match="already holds a tokenized dataset"):
        tokenize(files, tokenizer_file, out, field_name="body")
    with pytest.raises(ValueError, match="vocabulary of 300 tokens but model.vocab_size = 256"):
        ShardSource([(out, 1.0)], seed=0, seq_len=8, vocab_size=256)
    with pytest.raises(ValueError, match="no tokenized dataset"):
        TokenDataset(f"file://{tmp_path / 'nothing'}", seq_len=8)
    (tmp_path / "ds" / "shard-00000.bin").write_bytes(b"\0" * 12)
    with pytest.raises(ValueError, match="the dataset is damaged"):
        TokenDataset(out, seq_len=8)


def test_the_spec_takes_one_dataset_or_a_mixture() -> None:
    from controller.spec import SpecError, parse_spec

    raw = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())
    spec = parse_spec({**raw, "data": {"kind": "shards", "uri": "s3://bucket/ds"}})
    assert spec.data.to_config().datasets == (("s3://bucket/ds", 1.0),)
    spec = parse_spec({**raw, "data": {"kind": "shards", "datasets": [{"uri": "file:///a", "weight": 3},
                                                                      {"uri": "file:///b"}]}})
    assert spec.data.to_config().datasets == (("file:///a", 3.0), ("file:///b", 1.0))
    with pytest.raises(SpecError, match="not both"):
        parse_spec({**raw, "data": {"kind": "shards", "uri": "file:///a", "datasets": [{"uri": "file:///b"}]}})
    with pytest.raises(SpecError, match="for kind shards"):
        parse_spec({**raw, "data": {"kind": "synthetic", "uri": "file:///a"}})


def test_a_model_learns_from_tokenized_text(tmp_path: Path, tokenizer_file: Path) -> None:
    """Single process, the trainer on `data.kind: shards`: the loss on the text falls well below a
    uniform guess over the vocabulary."""
    import math

    import torch.distributed as dist

    from trainer.config import DataConfig, MeshShape, ModelConfig, TrainConfig, TrainerConfig
    from trainer.parallel import build_mesh, choose_device
    from trainer.train import Trainer

    out = tmp_path / "ds"
    (tmp_path / "in").mkdir()
    (corpus := tmp_path / "in" / "c.txt").write_text(" ".join(TEXTS) * 10, encoding="utf-8")
    tokenize([corpus], tokenizer_file, f"file://{out}")
    cfg = TrainerConfig(model=ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=320, seq_len=32),
                        data=DataConfig(kind="shards", datasets=((f"file://{out}", 1.0),), seed=0),
                        train=TrainConfig(steps=40, global_batch=16, micro_batch=8, lr=1e-2, dtype="float32",
                                          warmup_steps=5, grad_clip=1.0),
                        mesh=MeshShape())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        trainer = Trainer(cfg, build_mesh(cfg.mesh, "cpu"), choose_device("float32"))
        losses = [trainer.train_step().loss for _ in range(cfg.train.steps)]
    finally:
        dist.destroy_process_group()
    assert losses[-1] is not None and losses[-1] < math.log(320) - 2.0, losses


def test_a_damaged_shard_is_a_data_error_naming_the_file(tmp_path: Path, tokenizer_file: Path) -> None:
    """A bit flipped in a shard (a token id past the vocabulary) and a shard a store serves short both
    name the file, so `goodput status` says which one to replace."""
    out = tmp_path / "ds"
    tokenize(_files(tmp_path / "in"), tokenizer_file, f"file://{out}", field_name="body", shard_tokens=33)
    shard = sorted(out.glob("shard-*.bin"))[1]
    tokens = np.fromfile(shard, dtype="<u4")
    tokens[5] = 70000  # beyond the tokenizer's 300
    tokens.tofile(shard)
    source = ShardSource([(f"file://{out}", 1.0)], seed=5, seq_len=8, vocab_size=300)
    with pytest.raises(ValueError, match=rf"data error: file://{out}/{shard.name} holds token id 70000"):
        source.batch(range(source.sets[0].num_windows))

    class Short:  # a store that answers a byte range with less than asked (a truncated object)
        uri = "s3://bucket/ds"

        def get_bytes(self, key: str, start: int, end: int) -> bytes:
            return b"\0" * (end - start - 4)

        def local_path(self, key: str) -> None:
            return None

    from trainer.shards import _Shard

    with pytest.raises(ValueError, match="data error: s3://bucket/ds/shard-00001.bin gave 28 bytes for tokens 0..8"):
        _Shard(Short(), "shard-00001.bin", 33).read(0, 8)
