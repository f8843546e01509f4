"""`MemoryStore` (the simulator's object store) keeps its keys sorted so that a listing or a prefix's
delete is a range, not a scan of every key: a 54-day simulated run at 131,072 GPUs writes a fence
record per attempt (thousands) beside the run's steps, and retention lists the run after every
commit. Checked against the plain rule: a dict filtered by `startswith`, sorted."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointing.store import AlreadyExists, MemoryStore

import pytest

KEYS = st.text(alphabet="ab/.-0", min_size=0, max_size=6)
OPS = st.lists(st.tuples(st.sampled_from(["put", "delete", "list", "after"]), KEYS, KEYS), max_size=60)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_listings_and_deletes_match_a_plain_filter(ops: list[tuple[str, str, str]]) -> None:
    clock = iter(range(10**6))
    store = MemoryStore(lambda: float(next(clock)))
    reference: dict[str, tuple[bytes, float]] = {}
    for i, (op, key, after) in enumerate(ops):
        if op == "put":
            data = str(i).encode()
            store.put_bytes(key, data)
            reference[key] = (data, -1.0)
        elif op == "delete":
            store.delete_prefix(key)
            reference = {k: v for k, v in reference.items() if not k.startswith(key)}
        listed = store.list(key if op == "list" else "")
        expected = sorted(k for k in reference if k.startswith(key if op == "list" else ""))
        assert [o.key for o in listed] == expected
        assert all(o.size == len(reference[o.key][0]) for o in listed)
        assert all(store.get_bytes(o.key) == reference[o.key][0] for o in listed)
        if op == "after":  # S3's StartAfter: the keys under the prefix that sort after `after`
            assert [o.key for o in store.list(key, start_after=after)] == sorted(
                k for k in reference if k.startswith(key) and (k > after or not after))  # ("": no bound)


def test_a_rewrite_keeps_one_key_with_the_new_bytes_and_time() -> None:
    now = [1.0]
    store = MemoryStore(lambda: now[0])
    store.put_bytes("run/a", b"one")
    now[0] = 2.0
    store.put_bytes("run/a", b"three")
    [info] = store.list("run/")
    assert (info.key, info.size, info.mtime) == ("run/a", 5, 2.0)
    with pytest.raises(AlreadyExists):
        store.put_bytes("run/a", b"x", if_absent=True)
    assert store.get_bytes("run/a") == b"three"
