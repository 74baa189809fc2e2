"""The replica router: fewest waiting prompt tokens, prefix affinity within a slack, dead
replicas left out."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bulletserve.replicas.router import NoReplicaError, ReplicaLoad, Router, prefix_key


def load(waiting: int, streams: int = 0, healthy: bool = True) -> ReplicaLoad:
    return ReplicaLoad(healthy, waiting, streams)


def test_the_replica_with_the_fewest_waiting_tokens_gets_the_request():
    router = Router(affinity=False)
    assert router.choose([load(500), load(100), load(300)], key=None) == 1
    # Ties go to the fewest open streams, then the lowest index.
    assert router.choose([load(0, 3), load(0, 1), load(0, 1)], key=None) == 1


def test_a_dead_replica_is_never_chosen_and_none_left_raises():
    router = Router()
    assert router.choose([load(0, healthy=False), load(900)], key=None) == 1
    with pytest.raises(NoReplicaError):
        router.choose([load(0, healthy=False)], key=None)


def test_a_prefix_goes_back_to_its_replica_while_that_is_within_the_slack():
    router = Router(affinity_slack_tokens=1000)
    key = prefix_key(list(range(300)))
    assert router.choose([load(0), load(10)], key) == 0
    # Busier by less than the slack: the replica holding the prefix keeps it.
    assert router.choose([load(900), load(0)], key) == 0
    # Busier by more: the least loaded takes it, and becomes the prefix's home.
    assert router.choose([load(1500), load(0)], key) == 1
    assert router.choose([load(0), load(500)], key) == 1
    # Its home dead: the least loaded.
    assert router.choose([load(0), load(0, healthy=False)], key) == 0


def test_prompts_sharing_their_first_blocks_share_a_key():
    system = list(range(1000, 1300))
    assert prefix_key(system + [1, 2, 3]) == prefix_key(system + [4, 5])
    assert prefix_key(list(range(40))) == prefix_key(list(range(32)) + [7] * 8)
    assert prefix_key(list(range(15))) is None


def test_the_prefix_table_is_bounded():
    router = Router(max_prefixes=3)
    for start in range(10):
        router.choose([load(0), load(0)], prefix_key(list(range(start, start + 32))))
    assert len(router._homes) == 3


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 10_000), st.integers(0, 50)), min_size=1))
def test_the_choice_is_always_a_healthy_replica(raw):
    loads = [ReplicaLoad(healthy, waiting, streams) for healthy, waiting, streams in raw]
    router = Router()
    if not any(load.healthy for load in loads):
        with pytest.raises(NoReplicaError):
            router.choose(loads, key=1)
        return
    chosen = router.choose(loads, key=1)
    assert loads[chosen].healthy
    fewest = min(load.waiting_tokens for load in loads if load.healthy)
    assert loads[chosen].waiting_tokens <= fewest + router.affinity_slack_tokens


def test_serve_refuses_replicas_without_ray_as_their_backend(capsys):
    from bulletserve.cli import main

    assert main(["serve", "--data-parallel-size", "2", "--model", "tiny"]) == 2
    assert "add --distributed-executor-backend ray" in capsys.readouterr().err
    assert main(["serve", "--data-parallel-size", "0"]) == 2
