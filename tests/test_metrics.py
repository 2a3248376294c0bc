from __future__ import annotations

from trainer.metrics import merged


def test_merged_is_the_union_of_intervals():
    """The profile's device-busy time and the DDP trace's overlap both rest on this union."""
    assert merged([(5, 7), (0, 2), (1, 3), (7, 8), (10, 11)]) == [(0, 3), (5, 8), (10, 11)]
    assert merged([(0, 10), (2, 3)]) == [(0, 10)] and merged([]) == []
