"""gpu/host_buffers.py and gpu/hop_copies.py: the pool of host buffers and the hop's copies."""
import pytest
import torch

from splitmoe.attention_service.gpu.hop_copies import CopiesByDevice, HostSide, OnDevice, Staged
from splitmoe.attention_service.gpu.host_buffers import MIN_BLOCK_BYTES, HostBuffers


class Copy:
    """An event as the pool sees one: done or not (a CUDA event's `query`)."""

    def __init__(self, done: bool = False):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_buffers_are_lent_in_the_shape_and_dtype_asked():
    pool = HostBuffers(pin=False)
    a = pool.take((3, 5), torch.bfloat16)
    b = pool.take((7,), torch.int64)
    assert a.shape == (3, 5) and a.dtype == torch.bfloat16
    assert b.shape == (7,) and b.dtype == torch.int64
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert pool.owns(a) and pool.owns(b) and pool.num_lent == 2
    assert not pool.owns(torch.empty(3))


def test_a_buffer_given_back_is_lent_again_not_a_new_one():
    pool = HostBuffers(pin=False)
    a = pool.take((1024,), torch.float32)
    pool.give_back(a)
    b = pool.take((16, 16), torch.float32)
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert pool.num_bytes == MIN_BLOCK_BYTES


def test_a_buffer_whose_copy_is_pending_is_not_lent_until_it_completes():
    pool = HostBuffers(pin=False)
    a = pool.take((8,), torch.float32)
    copy = Copy(done=False)
    pool.give_back(a, copy)
    b = pool.take((8,), torch.float32)
    assert b.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
    pool.give_back(b)
    copy.done = True
    c = pool.take((8,), torch.float32)
    d = pool.take((8,), torch.float32)
    assert {c.untyped_storage().data_ptr(), d.untyped_storage().data_ptr()} == {
        a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()}
    assert pool.num_bytes == 2 * MIN_BLOCK_BYTES


def test_the_smallest_free_buffer_that_fits_is_lent():
    pool = HostBuffers(pin=False)
    big = pool.take((4 * MIN_BLOCK_BYTES,), torch.uint8)
    small = pool.take((10,), torch.uint8)
    pool.give_back(big)
    pool.give_back(small)
    again = pool.take((100,), torch.uint8)
    assert again.untyped_storage().data_ptr() == small.untyped_storage().data_ptr()
    larger = pool.take((2 * MIN_BLOCK_BYTES,), torch.uint8)
    assert larger.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()


def test_giving_back_twice_or_a_stranger_is_refused():
    pool = HostBuffers(pin=False)
    a = pool.take((4,), torch.float32)
    pool.give_back(a)
    with pytest.raises(ValueError, match="not a buffer lent"):
        pool.give_back(a)
    with pytest.raises(ValueError, match="not a buffer lent"):
        pool.give_back(torch.empty(4))


def test_on_the_cpu_the_hop_copies_nothing():
    copies = CopiesByDevice()(torch.device("cpu"))
    assert isinstance(copies, HostSide)
    t = torch.randn(3, 4)
    staged = copies.to_host(t, t)
    assert staged.tensors[0] is t and staged.lent == []
    assert copies.to_device(t) is t
    out = copies.output_buffer((2, 3))
    assert out.dtype == torch.float32 and out.shape == (2, 3)


class Answer:
    """A layer call's handle whose answer is ready (backend.Ready's contract)."""

    def __init__(self, out):
        self.out, self.waits = out, 0

    def wait(self):
        self.waits += 1
        return self.out


def test_an_on_device_handle_copies_once_and_gives_back_the_staged_buffers():
    copies = HostSide()
    given_back = []
    copies.release = lambda staged: given_back.append(staged)
    staged = Staged((torch.zeros(1),))
    handle = OnDevice(Answer(torch.ones(2, 2)), copies, staged)
    first = handle.wait()
    assert torch.equal(first, torch.ones(2, 2))
    assert handle.wait() is first
    assert given_back == [staged]


@pytest.mark.cuda
def test_cuda_round_trip_through_page_locked_buffers():
    from splitmoe.attention_service.gpu.hop_copies import CudaHopCopies

    copies = CudaHopCopies(torch.device("cuda"))
    hidden = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 128, (16, 8), device="cuda")
    weights = torch.rand(16, 8, device="cuda")
    staged = copies.to_host(hidden, ids, weights)
    h, i, w = staged.tensors
    assert all(t.is_pinned() for t in (h, i, w))
    assert torch.equal(h, hidden.cpu()) and torch.equal(i, ids.cpu()) and torch.equal(w, weights.cpu())
    out = copies.output_buffer(hidden.shape)
    out.copy_(h.float() * 2)
    back = copies.to_device(out)
    copies.release(staged)
    assert back.device.type == "cuda"
    assert torch.equal(back, hidden.float() * 2)
    assert copies.buffers.num_lent == 0


@pytest.mark.cuda
def test_cuda_answer_reaches_the_device_before_the_next_kernel_reads_it():
    """The compute stream waits for the side stream's copy on the GPU: a kernel queued right
    after `to_device` sees the copied values, also when the host buffer is reused at once."""
    from splitmoe.attention_service.gpu.hop_copies import CudaHopCopies

    copies = CudaHopCopies(torch.device("cuda"))
    results = []
    for k in range(50):
        out = copies.output_buffer((64, 1024))
        out.fill_(float(k))
        results.append(copies.to_device(out).sum())  # queued on the compute stream, no host sync
    torch.cuda.synchronize()
    assert [float(r) for r in results] == [float(k) * 64 * 1024 for k in range(50)]
