"""The pure decision of the resize warning (issue 39 item 19): ``state.resize_notice``."""

from __future__ import annotations

import torch

from unickpt.state.resize_notice import differing_parts, peer_values, peer_what, shared_state_notice


def test_issue39_item19_no_notice_when_every_rank_saved_the_same() -> None:
    same = {"step": 100, "lr": 0.1, "t": torch.arange(3)}
    assert shared_state_notice("extra_state", [same, dict(same), dict(same)], 3) is None


def test_issue39_item19_notice_names_the_entries_that_differ() -> None:
    saved = [{"step": 100, "rng": torch.tensor([1, 2])}, {"step": 100, "rng": torch.tensor([1, 3])}]
    assert differing_parts("extra_state", saved) == ["extra_state['rng']"]
    notice = shared_state_notice("extra_state", saved, 2)
    assert notice is not None and "extra_state['rng']" in notice and "'step'" not in notice
    assert "r % 2" in notice and "extra_state_on_resize" in notice


def test_issue39_item19_notice_names_the_key_when_not_a_dict_of_the_same_keys() -> None:
    assert differing_parts("counter", [1, 2]) == ["counter"]
    assert differing_parts("extra_state", [{"a": 1}, {"b": 1}]) == ["extra_state"]
    assert shared_state_notice("big", [], 4, unread=True) is not None


def test_issue39_item19_peer_values_in_saved_rank_order() -> None:
    values = {"value": "own", peer_what(1): "b", peer_what(0): "a", peer_what(10): "k"}
    assert peer_values(values) == ["a", "b", "k"]
