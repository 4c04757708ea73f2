"""Speculative decoding's KV rollback (``kv.free(id, keep_tokens=n)``) in both modes: random
sequences of verify steps (grow by k + 1, keep what was accepted) next to forks, prefix hits
and frees leak no page, block or slot, a tensor-parallel follower applying rank 0's changes
agrees whole after every step, and rejected tokens never reach the prefix cache."""

from __future__ import annotations

import random

import pytest
from test_kv_changes import ranks, shared_state, sync

from vmkv.kv import KVCacheManager


def test_rollback_checks_its_arguments() -> None:
    leader, follower = ranks("paged")
    assert leader.allocate("a", 20)
    with pytest.raises(ValueError, match="keep_tokens must be in"):
        leader.free("a", keep_tokens=21)
    with pytest.raises(ValueError, match="keep_tokens must be in"):
        leader.free("a", keep_tokens=-1)
    with pytest.raises(KeyError):
        leader.free("nobody", keep_tokens=0)
    leader.free("a", keep_tokens=20)  # nothing to give back
    assert leader.room.num_tokens("a") == 20
    leader.free("a")
    leader.accounting.check()
    leader.close()
    follower.close()


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
def test_rollback_gives_back_what_lies_past_the_new_end(kv_mode: str) -> None:
    leader, follower = ranks(kv_mode)
    assert leader.allocate("a", 10)
    units = len(leader.room.units_of("a"))
    assert leader.allocate("a", 150)  # a long verify step
    assert len(leader.room.units_of("a")) > units
    leader.free("a", keep_tokens=11)
    sync(leader, follower)
    assert leader.room.num_tokens("a") == 11
    if kv_mode == "paged":  # blocks past the new end are freed
        assert len(leader.room.units_of("a")) == 1
    else:  # pages past it stay mapped only up to the premap bound
        kept = leader.mapped_pages(leader.slot("a"))  # type: ignore[attr-defined]
        assert kept <= leader.layout.pages_for(11) + leader.premap_pages  # type: ignore[attr-defined]
    assert shared_state(leader) == shared_state(follower)
    leader.accounting.check()
    leader.free("a")
    leader.accounting.check()
    leader.close()
    follower.close()


def _walk(leader: KVCacheManager, follower: KVCacheManager, rng: random.Random) -> None:
    """Random verify steps over a few requests with prefix caching, forks and frees."""
    prompt = [rng.randrange(1000) for _ in range(48)]
    tokens: dict[str, list[int]] = {}  # the verified tokens of each live request
    computed: dict[str, int] = {}
    for step in range(120):
        live = list(tokens)
        if len(live) < 3 and rng.random() < 0.3:
            rid = f"r{step}"
            seq = prompt + [rng.randrange(1000) for _ in range(rng.randrange(1, 20))]
            hit = leader.prefix.match(rid, seq)
            if not leader.allocate(rid, len(seq) - hit):
                if hit:
                    leader.free(rid)
                continue
            leader.prefix.publish(rid, seq, len(seq))
            tokens[rid], computed[rid] = seq, len(seq)
        elif live and rng.random() < 0.05:
            rid = rng.choice(live)
            child = f"{rid}.f{step}"
            if leader.fork(rid, child):
                tokens[child], computed[child] = list(tokens[rid]), computed[rid]
        elif live and rng.random() < 0.08:
            rid = rng.choice(live)
            leader.free(rid)
            del tokens[rid], computed[rid]
        elif live:
            rid = rng.choice(live)
            k = rng.randrange(0, 8)
            if computed[rid] + k + 1 > leader.room.max_model_len or not leader.allocate(
                    rid, k + 1):
                leader.free(rid)
                del tokens[rid], computed[rid]
            else:
                accepted = rng.randrange(0, k + 1)  # m - 1 of the k drafts, then the bonus
                keep = computed[rid] + accepted + 1
                leader.free(rid, keep_tokens=keep)
                tokens[rid] += [rng.randrange(1000) for _ in range(keep - computed[rid])]
                computed[rid] = keep
                leader.prefix.publish(rid, tokens[rid], keep)  # only verified tokens
        sync(leader, follower)
        assert shared_state(leader) == shared_state(follower)
        leader.accounting.check()
    for rid in list(tokens):
        leader.free(rid)
    sync(leader, follower)
    leader.prefix.reset()
    sync(leader, follower)
    leader.accounting.check()
    assert leader.room.request_ids() == []


@pytest.mark.parametrize("kv_mode", ["virtual", "paged"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_accept_reject_leaks_nothing_and_ranks_agree(kv_mode: str, seed: int) -> None:
    leader, follower = ranks(kv_mode)
    _walk(leader, follower, random.Random(seed))
    usage = leader.accounting.usage
    assert (usage.num_requests, usage.num_tokens, usage.bytes_in_use) == (0, 0, 0)
    assert shared_state(leader) == shared_state(follower)
    leader.close()
    follower.close()
