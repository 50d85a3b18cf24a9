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
