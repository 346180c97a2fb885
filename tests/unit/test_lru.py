"""hvdlite/_lru.py: the bounded tables per-name state lives in (issue 26)."""

from __future__ import annotations

from hvdlite._lru import Bounded


def test_least_recently_used_out_and_zero_keeps_nothing() -> None:
    table: Bounded[str, int] = Bounded(3)
    for i, key in enumerate("abc"):
        table.keep(key, i)
    assert table.used("a") == 0  # a is now the newest
    table.keep("d", 3)
    assert list(table) == ["c", "a", "d"]  # b, the least recently used, went
    table.keep("c", 9)  # kept again: the newest, one entry
    assert list(table.items()) == [("a", 0), ("d", 3), ("c", 9)]
    assert table.get("a") == 0 and list(table)[0] == "a"  # get does not reorder
    table.drop("d")
    table.drop("missing")
    assert list(table) == ["a", "c"]
    off: Bounded[str, int] = Bounded(0)
    off.keep("a", 1)
    assert not off and off.used("a") is None


def test_weighted_entries_bound_their_total() -> None:
    """A plan over n responses weighs n: the table holds at most ``capacity`` in all."""
    table: Bounded[str, str] = Bounded(10)
    table.keep("p4", "four", 4)
    table.keep("p5", "five", 5)
    table.keep("one", "1")
    assert list(table) == ["p4", "p5", "one"]  # 10 in all
    table.keep("p3", "three", 3)  # p4 goes: 5 + 1 + 3
    assert list(table) == ["p5", "one", "p3"]
    table.keep("big", "eleven", 11)  # heavier than the whole table: not kept, nothing lost
    assert list(table) == ["p5", "one", "p3"]
    table.drop("p5")
    for i in range(6):
        table.keep(f"s{i}", "x")  # 1 + 3 + 6 = 10
    assert list(table) == ["one", "p3", *(f"s{i}" for i in range(6))]
    table.keep("s6", "x")
    assert list(table)[0] == "p3"
