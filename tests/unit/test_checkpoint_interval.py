"""The worker's checkpoint schedule: fixed every N, or Young/Daly from the first save's stall."""

from __future__ import annotations

from trainer.config import DataConfig, ModelConfig, TrainConfig, TrainerConfig
from trainer.report import ListSink
from trainer.worker import WorkerArgs, _Interval

CONFIG = TrainerConfig(model=ModelConfig(n_layers=1, d_model=8, n_heads=2, vocab_size=8, seq_len=4),
                       data=DataConfig(), train=TrainConfig(steps=1000, global_batch=2, micro_batch=2))


def args(**kw: object) -> WorkerArgs:
    return WorkerArgs(rank=0, world_size=1, store_host="127.0.0.1", store_port=1, store_prefix="x",
                      config=CONFIG, **kw)  # type: ignore[arg-type]


def test_fixed_interval_and_last_step() -> None:
    i = _Interval(args(checkpoint_every=20))
    assert [s for s in range(1, 1001) if i.due(s, 1000)][:3] == [20, 40, 60]
    assert i.due(1000, 1000) and not i.due(999, 1000)


def test_auto_interval_follows_young_daly() -> None:
    sink = ListSink()
    i = _Interval(args(checkpoint_auto=True, mtbf_s=3600.0))
    assert i.due(10, 1000) and not i.due(5, 1000)
    i.measured(blocked_s=0.5, step_time_s=0.2, sink=sink)  # sqrt(2 * 0.5 * 3600) = 60 s = 300 steps
    assert i.every == 300 and i.due(300, 1000) and not i.due(310, 1000)
    (kind, detail), = sink.events
    assert kind == "checkpoint_interval" and detail["steps"] == 300 and detail["rule"] == "young_daly"
    i.measured(blocked_s=5.0, step_time_s=0.2, sink=sink)
    assert i.every == 300 and len(sink.events) == 1, "chosen once, from the first measured save"
