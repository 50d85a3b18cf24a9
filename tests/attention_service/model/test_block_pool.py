"""The KV block pool: names chained over the prefix, reference counts, LRU eviction, revival."""
from splitmoe.attention_service.model.block_pool import ROOT_HASH, BlockPool, hash_block_tokens


def chain(blocks_of_tokens, extra_keys=()):
    names, parent = [], ROOT_HASH
    for tokens in blocks_of_tokens:
        parent = hash_block_tokens(parent, tokens, extra_keys)
        names.append(parent)
    return names


def test_a_blocks_name_depends_on_everything_before_it_and_on_the_extra_keys():
    a = chain([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert a == chain([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert a[1] != chain([[9, 2, 3, 4], [5, 6, 7, 8]])[1]  # same tokens after another prefix
    assert a[0] != chain([[1, 2, 3, 5]])[0]
    assert a[0] != chain([[1, 2, 3, 4]], extra_keys=(1,))[0]  # e.g. another experts-per-token count
    assert len(set(a)) == 2 and all(len(name) == 32 for name in a)


def test_allocation_goes_in_order_and_reference_counts_hold_blocks():
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(3)]
    assert blocks == [0, 1, 2] and pool.num_free == 1
    assert pool.name(0, b"n0")
    pool.acquire(0)  # a second sequence shares block 0
    assert pool.ref_count(0) == 2
    pool.release([0, 1, 2])
    assert pool.ref_count(0) == 1 and not pool.is_free(0) and pool.num_free == 3
    pool.release([0])
    assert pool.is_free(0) and pool.num_free == 4 and pool.lookup(b"n0") == 0  # free, still named


def test_unnamed_blocks_are_handed_out_before_named_ones_and_named_ones_least_recently_freed_first():
    pool = BlockPool(6)
    first, second = [pool.allocate() for _ in range(3)], [pool.allocate() for _ in range(3)]
    for block, name in zip(first + second[:2], (b"a0", b"a1", b"a2", b"b0", b"b1")):
        pool.name(block, name)
    pool.release(first)  # a sequence of three full blocks ends
    pool.release(second)  # then one of two full blocks and a partial one
    order = [pool.allocate() for _ in range(6)]
    # the partial block first; then the first sequence's blocks, its last one first; then the second's
    assert order == [5, 2, 1, 0, 4, 3]
    assert pool.num_cached == 0 and pool.lookup(b"a0") is None  # handing out forgets the name


def test_a_hit_on_a_free_named_block_revives_it_so_it_is_not_evicted():
    pool = BlockPool(3)
    blocks = [pool.allocate() for _ in range(2)]
    pool.name(blocks[0], b"prefix")
    pool.release(blocks)
    hit = pool.lookup(b"prefix")
    pool.acquire(hit)
    assert not pool.is_free(hit) and pool.ref_count(hit) == 1 and pool.num_free == 2
    assert sorted(pool.allocate() for _ in range(2)) == [1, 2]  # the revived block stays out of reach
    assert pool.lookup(b"prefix") == hit


def test_a_name_already_held_by_another_block_stays_with_the_first():
    pool = BlockPool(2)
    a, b = pool.allocate(), pool.allocate()
    assert pool.name(a, b"same")
    assert not pool.name(b, b"same")  # two sequences computed the same block at once
    assert pool.lookup(b"same") == a
    pool.release([b])
    assert pool.allocate() == b  # unnamed: back at the front of the queue
