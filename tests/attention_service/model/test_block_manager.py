"""Per-sequence block tables over the pool, and prefix caching's part: name, find, take, count."""
import pytest

from splitmoe.attention_service.model.block_manager import BlockManager, KVCacheFull
from splitmoe.attention_service.model.sequence import Sequence


def computed(blocks, seq, num_tokens):
    """What the runner does for a step: reserve, (compute), count, name the filled blocks."""
    blocks.reserve(seq.seq_id, num_tokens)
    seq.num_cached_tokens = num_tokens
    blocks.commit(seq)


def test_reserve_slots_and_free_without_prefix_caching():
    blocks = BlockManager(4, 4)
    seq = Sequence(0, list(range(10)))
    computed(blocks, seq, 10)
    assert blocks.slots(0, 0, 10).tolist() == list(range(10)) and blocks.num_free_blocks == 1
    assert blocks.cached_prefix(Sequence(1, list(range(10)))).blocks == ()  # off: nothing is named
    with pytest.raises(KVCacheFull):
        blocks.reserve(2, 8)
    blocks.free(0)
    assert blocks.num_free_blocks == 4


def test_a_new_sequence_takes_the_full_blocks_of_a_matching_prefix_and_never_its_last_token():
    blocks = BlockManager(16, 4, prefix_caching=True)
    a = Sequence(0, list(range(10)))  # blocks [0-3] [4-7] full, [8-9] partial
    computed(blocks, a, 10)
    same = Sequence(1, list(range(10)))
    assert len(blocks.cached_prefix(same).blocks) == 2
    exact = Sequence(2, list(range(8)))  # two full blocks, but its last token must be computed
    assert len(blocks.cached_prefix(exact).blocks) == 1
    other = Sequence(3, [0, 1, 2, 3, 9, 9, 9, 9, 9])  # diverges in the second block
    assert len(blocks.cached_prefix(other).blocks) == 1
    experts = Sequence(4, list(range(10)), num_experts_per_token=1)  # other KV for the same tokens
    assert blocks.cached_prefix(experts).blocks == ()


def test_taking_shares_the_blocks_counts_the_hit_and_continues_the_chain():
    blocks = BlockManager(16, 4, prefix_caching=True)
    computed(blocks, Sequence(0, list(range(12))), 12)
    b = Sequence(1, list(range(12)) + [50, 51, 52, 53, 54])
    hit = blocks.cached_prefix(b)
    assert blocks.blocks_to_take(b, hit, 17) == 2  # 3 shared blocks held by sequence 0: only 2 new
    blocks.take(b, hit, admitted=True)
    assert b.num_cached_tokens == 12
    assert blocks.slots(1, 0, 12).tolist() == blocks.slots(0, 0, 12).tolist()
    assert all(blocks.pool.ref_count(block) == 2 for block in hit.blocks)
    computed(blocks, b, 17)  # its fourth block is full now, named after the shared three
    c = Sequence(2, list(b.token_ids) + [7])
    assert len(blocks.cached_prefix(c).blocks) == 4
    assert (blocks.prefix_stats.queries, blocks.prefix_stats.hits) == (17, 12)


def test_freed_blocks_stay_findable_until_new_tokens_need_them():
    blocks = BlockManager(4, 4, prefix_caching=True)
    a = Sequence(0, list(range(9)))
    computed(blocks, a, 9)
    blocks.free(0)
    again = Sequence(1, list(range(9)))
    hit = blocks.cached_prefix(again)
    assert len(hit.blocks) == 2 and blocks.blocks_to_take(again, hit, 9) == 3  # reviving two, one new
    computed(blocks, Sequence(2, [99] * 13), 13)  # needs all four blocks: every name is evicted
    assert blocks.cached_prefix(again).blocks == ()
