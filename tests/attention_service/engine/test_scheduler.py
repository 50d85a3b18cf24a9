"""Continuous batching decisions, with no model: chunked prefill, decodes first, preemption."""
from splitmoe.attention_service.engine.request import GenerationRequest
from splitmoe.attention_service.engine.scheduler import Scheduler
from splitmoe.attention_service.model.block_manager import BlockManager
from splitmoe.attention_service.model.sequence import Sequence


def request(seq_id, num_tokens):
    # Only the sequence matters to the scheduler; the sampling parts stay empty here.
    return GenerationRequest(request_id=f"r{seq_id}", seq=Sequence(seq_id, list(range(num_tokens))), options=None,
                             sampler=None, detokenizer=None, sink=None, stop_ids=frozenset(), max_context_tokens=4096)


def run(step):
    """What the model runner does to the sequences, and a sampled token for finished prompts."""
    for r, n in zip(step.requests, step.num_new_tokens):
        r.seq.num_cached_tokens += n
        if r.seq.num_cached_tokens == r.seq.num_tokens:
            r.seq.token_ids.append(0)


def test_long_prompt_is_prefilled_in_chunks_within_the_budget():
    s = Scheduler(BlockManager(64, 4), max_batch_tokens=8, max_running_seqs=8, max_waiting=8)
    s.add(request(0, 20))
    sizes = []
    for _ in range(4):
        step = s.schedule()
        sizes.append(step.num_new_tokens)
        run(step)
    assert sizes == [[8], [8], [4], [1]]


def test_running_decodes_go_first_and_new_prompts_fill_the_rest():
    s = Scheduler(BlockManager(64, 4), max_batch_tokens=8, max_running_seqs=8, max_waiting=8)
    s.add(request(0, 3))
    run(s.schedule())
    s.add(request(1, 30))
    step = s.schedule()
    assert [r.request_id for r in step.requests] == ["r0", "r1"]
    assert step.num_new_tokens == [1, 7]


def test_max_running_and_queue_limit():
    s = Scheduler(BlockManager(64, 4), max_batch_tokens=64, max_running_seqs=2, max_waiting=3)
    for i in range(3):
        s.add(request(i, 2))
    try:
        s.add(request(9, 2))
        raise AssertionError("a full queue must refuse")
    except RuntimeError as e:
        assert "full" in str(e)
    assert len(s.schedule().requests) == 2


def test_kv_exhaustion_preempts_the_newest_and_recomputes_it_later():
    s = Scheduler(BlockManager(3, 4), max_batch_tokens=64, max_running_seqs=8, max_waiting=8)
    a, b = request(0, 4), request(1, 4)
    s.add(a)
    s.add(b)
    run(s.schedule())  # both prompts: one block each, one block free
    step = s.schedule()  # a takes the free block; b finds none and waits its turn, keeping its KV
    assert step.requests == [a] and b in s.running
    run(step)
    for _ in range(3):  # a fills its second block
        run(s.schedule())
    step = s.schedule()  # a needs a third block: b, the newest, is preempted for it
    assert step.requests == [a] and b in s.waiting and b.seq.num_cached_tokens == 0
    s.remove("r0")
    step = s.schedule()
    assert step.requests == [b] and step.num_new_tokens == [b.seq.num_tokens]


# ---- with prefix caching --------------------------------------------------------------------------

def prompt(seq_id, token_ids):
    r = request(seq_id, 0)
    r.seq.token_ids.extend(token_ids)
    r.num_prompt_tokens = len(token_ids)
    return r


def run_and_name(s, step):
    """`run`, and the runner's naming of the blocks each step filled."""
    run(step)
    for r in step.requests:
        s.blocks.commit(r.seq)


SHARED = list(range(100, 120))  # five blocks of 4


def test_a_request_with_a_cached_prefix_prefills_only_the_rest():
    s = Scheduler(BlockManager(64, 4, prefix_caching=True), max_batch_tokens=64, max_running_seqs=8, max_waiting=8)
    s.add(prompt(0, SHARED + [1, 2]))
    run_and_name(s, s.schedule())
    s.add(prompt(1, SHARED + [3, 4, 5]))
    step = s.schedule()
    assert step.num_new_tokens == [1, 3]  # the first's decode; the second's three tokens after the shared 20
    assert s.blocks.prefix_stats.hits == 20


def test_a_request_waits_for_room_for_a_whole_block_then_takes_what_filled_meanwhile():
    s = Scheduler(BlockManager(64, 4, prefix_caching=True), max_batch_tokens=8, max_running_seqs=8, max_waiting=8)
    first, second = prompt(0, SHARED + [1, 2]), prompt(1, SHARED + [3, 4])
    s.add(first)
    s.add(second)
    sizes = []
    for _ in range(4):
        step = s.schedule()
        sizes.append(step.num_new_tokens)
        run_and_name(s, step)
    # 2 tokens of budget left in the third step reach no block end: the second request waits one
    # step, and then finds all five of the first's shared blocks named
    assert sizes == [[8], [8], [6], [1, 2]]


def test_a_chunked_prompt_takes_the_blocks_its_neighbour_filled_before_its_next_chunk():
    s = Scheduler(BlockManager(64, 4, prefix_caching=True), max_batch_tokens=30, max_running_seqs=8, max_waiting=8)
    s.add(prompt(0, SHARED + [1, 2]))
    s.add(prompt(1, SHARED + [3, 4]))
    step = s.schedule()
    assert step.num_new_tokens == [22, 8]  # both compute the start of the prefix: nothing is named yet
    run_and_name(s, step)
    step = s.schedule()
    assert step.num_new_tokens == [1, 2]  # the second took blocks 2-4 from the first
    assert s.blocks.prefix_stats.hits == 12


def test_a_preempted_request_recomputes_only_what_was_evicted():
    s = Scheduler(BlockManager(7, 4, prefix_caching=True), max_batch_tokens=64, max_running_seqs=8, max_waiting=8)
    a, b = prompt(0, list(range(12))), prompt(1, list(range(50, 62)))
    s.add(a)
    s.add(b)
    run_and_name(s, s.schedule())  # 3 blocks each, one free
    for _ in range(4):  # a fills its fourth block...
        run_and_name(s, s.schedule())
    step = s.schedule()  # ...and needs a fifth: b is preempted, its named blocks freed but kept,
    assert step.requests == [a] and b in s.waiting  # and a's new block is b's last one (evicted first)
    run_and_name(s, step)
    s.remove("r0")
    step = s.schedule()
    assert step.requests == [b] and step.num_new_tokens == [b.seq.num_tokens - 8]  # b's first two blocks back
