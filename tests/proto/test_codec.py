"""proto/codec.py: every wire dtype round-trips exactly through bytes; malformed messages are refused."""
import pytest
import torch

from splitmoe.proto import codec, tensor_pb2

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64]
# Decoded tensors alias the message bytes; torch's one-time warning about that is expected.
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
SHAPES = [(0, 64), (3, 0), (1,), (), (5, 7), (2, 3, 4)]


def sample(shape, dtype):
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-(2**31), 2**31 - 1, shape, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bytes_round_trip(dtype, shape):
    t = sample(shape, dtype)
    wire = tensor_pb2.Tensor.FromString(codec.encode(t).SerializeToString())
    back = codec.decode(wire)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_input(dtype):
    t = sample((6, 8), dtype)
    for view in (t.T, t[:, ::2], t[1:4, 2:5]):
        assert not view.is_contiguous()
        assert torch.equal(codec.decode(codec.encode(view)), view)


def test_dtype_and_shape_are_fields():
    msg = codec.encode(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert msg.dtype == tensor_pb2.DTYPE_BFLOAT16 and list(msg.shape) == [2, 3] and len(msg.data) == 12


def test_encode_fills_a_sub_message():
    outer = tensor_pb2.Tensor()
    codec.encode(torch.arange(4, dtype=torch.int32), outer)
    assert torch.equal(codec.decode(outer), torch.arange(4, dtype=torch.int32))


@pytest.mark.parametrize("bad", [
    dict(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[2, 2], data=b"\0" * 15),
    dict(dtype=tensor_pb2.DTYPE_UNSPECIFIED, shape=[1], data=b"\0" * 4),
    dict(dtype=tensor_pb2.DTYPE_INT32, shape=[-1, 2], data=b""),
])
def test_malformed_messages_raise(bad):
    with pytest.raises(ValueError):
        codec.decode(tensor_pb2.Tensor(**bad))


def test_unsupported_dtype_raises():
    with pytest.raises(ValueError, match="no wire encoding"):
        codec.encode(torch.zeros(2, dtype=torch.uint8))
