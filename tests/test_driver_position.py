"""A producer's position in its stream (rollout/driver/position.py): saved after each group stored, loaded by the next
producer, which neither repeats nor skips a group and draws a producer id none before it had."""

import itertools

from rollout.driver.position import Position
from rollout.driver.producer import item_stream, unstored_items


def test_a_position_round_trips_and_the_next_producer_runs_what_was_not_stored(tmp_path):
    path = tmp_path / "position.json"
    items = list("abcdefg")
    first = Position.load(path)
    first_id = first.new_producer_id()
    for index in (0, 1, 2, 4, 5):  # group 3 was in flight when the producer died; 6 never started
        first.stored(index)
    assert (first.next_index, first.stored_above) == (3, {4, 5})

    second = Position.load(path)
    assert (second.next_index, second.stored_above, second.producer_ids) == (3, {4, 5}, [first_id])
    assert second.new_producer_id() != first_id
    stream = list(itertools.islice(item_stream(items, seed=3), 10))
    resumed = list(itertools.islice(unstored_items(items, 3, second), 4))
    assert resumed == [(3, stream[3]), (6, stream[6]), (7, stream[7]), (8, stream[8])]
    assert Position.load(path).producer_ids == [first_id, second.producer_ids[-1]]


def test_a_configured_producer_id_is_kept_and_no_path_saves_nothing(tmp_path):
    position = Position.load(None)
    assert position.new_producer_id("fixed") == "fixed"
    position.stored(0)
    assert position.next_index == 1 and not list(tmp_path.iterdir())
