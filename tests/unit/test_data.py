"""Data: samples are a pure function of (seed, id); a dp change neither skips nor repeats a sample;
the synthetic source's entropy rate is what the chain says."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from trainer.data import MarkovChain, SyntheticSource, TokenFileSource, local_sample_ids


@pytest.mark.parametrize("dps", [(2, 1), (4, 2, 1), (1, 8), (8, 4, 2, 1)])
def test_dp_changes_neither_skip_nor_repeat(dps: tuple[int, ...]) -> None:
    """Steps run on a sequence of dp degrees with the cursor carried between them: every sample id
    in [0, steps * global_batch) is used exactly once."""
    global_batch, micro_batch, steps_each = 16, 2, 3
    used: Counter[int] = Counter()
    cursor = 0
    for dp in dps:
        for _ in range(steps_each):
            for rank in range(dp):
                used.update(local_sample_ids(cursor=cursor, global_batch=global_batch, dp=dp,
                                             dp_rank=rank, micro_batch=micro_batch))
            cursor += global_batch
    total = len(dps) * steps_each * global_batch
    assert sorted(used) == list(range(total))
    assert set(used.values()) == {1}


def test_local_ids_are_split_in_micro_batches() -> None:
    ids = local_sample_ids(cursor=32, global_batch=16, dp=2, dp_rank=1, micro_batch=2)
    assert ids == [34, 35, 38, 39, 42, 43, 46, 47]


def test_sample_is_pure_function_of_seed_and_id() -> None:
    a = SyntheticSource(seed=5, vocab_size=32, seq_len=16, branching=3)
    b = SyntheticSource(seed=5, vocab_size=32, seq_len=16, branching=3)
    together = a.batch([7, 3, 11])
    assert np.array_equal(together[1], b.batch([3])[0])
    assert not np.array_equal(together[0], together[1])
    assert not np.array_equal(SyntheticSource(seed=6, vocab_size=32, seq_len=16, branching=3).batch([7]),
                              together[:1])


def test_synthetic_follows_the_chain_and_its_entropy_rate() -> None:
    """Independent check: the mean of -log P(next | current) over sampled text equals the closed-form
    entropy rate, and no sampled transition has zero probability."""
    src = SyntheticSource(seed=1, vocab_size=24, seq_len=64, branching=4)
    rows = src.batch(range(400))
    p = src.chain.transition[rows[:, :-1], rows[:, 1:]]
    assert (p > 0).all()
    empirical = float(-np.log(p).mean())
    assert abs(empirical - src.chain.entropy_rate()) < 0.03


def test_entropy_rate_of_a_known_chain() -> None:
    """A deterministic cycle has entropy 0; a uniform chain over V tokens has log V."""
    v = 8
    cycle = MarkovChain(transition=np.roll(np.eye(v), 1, axis=1), stationary=np.full(v, 1 / v))
    assert cycle.entropy_rate() == 0.0
    uniform = MarkovChain(transition=np.full((v, v), 1 / v), stationary=np.full(v, 1 / v))
    assert uniform.entropy_rate() == pytest.approx(np.log(v))
    chain = MarkovChain.from_seed(0, 16, 16)
    assert np.allclose(chain.stationary @ chain.transition, chain.stationary, atol=1e-12)


def test_token_file_windows_cover_each_epoch_once(tmp_path) -> None:
    seq_len, n_windows = 4, 10
    tokens = np.arange(seq_len * n_windows + 1, dtype=np.uint16)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    src = TokenFileSource(path=str(path), seed=0, seq_len=seq_len, vocab_size=1000)
    rows = src.batch(range(2 * n_windows))
    starts = rows[:, 0]
    assert sorted(starts[:n_windows]) == list(range(0, seq_len * n_windows, seq_len))
    assert sorted(starts[n_windows:]) == sorted(starts[:n_windows])
    assert all((row == np.arange(row[0], row[0] + seq_len + 1)).all() for row in rows)


def test_token_file_rejects_ids_outside_vocab(tmp_path) -> None:
    path = tmp_path / "tokens.bin"
    np.array([1, 2, 300, 4, 5], dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match="token id 300 .* >= model.vocab_size = 256"):
        TokenFileSource(path=str(path), seed=0, seq_len=4, vocab_size=256).batch([0])
