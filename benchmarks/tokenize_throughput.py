"""`goodput tokenize` throughput against Hugging Face `tokenizers`' own batch encode of the same
documents, measured side by side (interleaved, n rounds each), on a generated corpus of .jsonl files
and a BPE tokenizer trained on it here. Prints MB of text per second for each, per core, and the
ratio (goal >= 0.8: reading, EOS, shards and checksums cost at most a fifth of the encode).

    python benchmarks/tokenize_throughput.py [--mb 24] [--rounds 3]

Its record: benchmarks/records/tokenize_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import records  # noqa: E402


def corpus(root: Path, megabytes: float, seed: int = 0) -> list[Path]:
    """Four .jsonl files of documents of 50-400 words drawn from a Zipf-like list of made-up words."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(20000)]
    weights = [1 / (i + 1) for i in range(len(words))]
    paths, per_file = [], megabytes * 1e6 / 4
    for n in range(4):
        path = root / f"part{n}.jsonl"
        size = 0
        with path.open("w", encoding="utf-8") as f:
            while size < per_file:
                text = " ".join(rng.choices(words, weights, k=rng.randint(50, 400))) + "."
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                size += len(line)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=24.0)
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from trainer.tokenize import BATCH_DOCUMENTS, documents, tokenize

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = corpus(root, opts.mb)
        docs = list(documents(paths, "text"))
        text_mb = sum(len(d.encode()) for d in docs) / 1e6
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(docs[:2000], trainer=trainers.BpeTrainer(
            vocab_size=8000, special_tokens=["<|end_of_text|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok.save(str(root / "tokenizer.json"))

        def ours(i: int) -> float:
            t0 = time.perf_counter()
            tokenize(paths, root / "tokenizer.json", f"file://{root / f'out{i}'}")
            return time.perf_counter() - t0

        def library() -> float:
            t0 = time.perf_counter()
            for start in range(0, len(docs), BATCH_DOCUMENTS):
                tok.encode_batch(docs[start:start + BATCH_DOCUMENTS], add_special_tokens=False)
            return time.perf_counter() - t0

        ours(-1), library()  # warm both (file cache, thread pool)
        a, b = [], []
        for i in range(opts.rounds):
            a.append(ours(i))
            b.append(library())
    cores = len(os.sched_getaffinity(0))
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"corpus: {text_mb:.1f} MB of text in {len(docs):,} documents; {cores} cores; n = {opts.rounds} each")
    print(f"goodput tokenize (read, encode, EOS, shards, sha256, manifest): {text_mb / ma:.1f} MB/s "
          f"({text_mb / ma / cores:.1f} MB/s per core); runs {', '.join(f'{x:.2f}' for x in a)} s")
    print(f"tokenizers encode_batch alone: {text_mb / mb:.1f} MB/s ({text_mb / mb / cores:.1f} MB/s per core); "
          f"runs {', '.join(f'{x:.2f}' for x in b)} s")
    print(f"throughput ratio goodput / tokenizers (medians): {mb / ma:.3f} (goal >= 0.8)")
    ours_mb_s, library_mb_s = [text_mb / x for x in a], [text_mb / x for x in b]
    figures = [records.figure("tokenize: goodput tokenize", ours_mb_s, "MB/s"),
               records.figure("tokenize: goodput tokenize, per core", [x / cores for x in ours_mb_s], "MB/s"),
               records.figure("tokenize: tokenizers encode_batch alone", library_mb_s, "MB/s"),
               records.figure("tokenize: tokenizers encode_batch alone, per core", [x / cores for x in library_mb_s],
                              "MB/s"),
               records.figure("tokenize: goodput / tokenizers (medians)", [mb / ma], "ratio", goal=">= 0.8")]
    records.write("tokenize_throughput", figures, code=["trainer/tokenize.py", "trainer/shards.py"],
                  extra={"text_mb": text_mb, "documents": len(docs), "cores": cores})


if __name__ == "__main__":
    main()
