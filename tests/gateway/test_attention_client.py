"""gRPC status codes as the HTTP statuses the gateway answers with."""
import grpc
import pytest

from gateway.attention_client import AttentionError


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@pytest.mark.parametrize("code, status", [
    (grpc.StatusCode.INVALID_ARGUMENT, 400),
    (grpc.StatusCode.NOT_FOUND, 404),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (grpc.StatusCode.UNAVAILABLE, 503),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    (grpc.StatusCode.INTERNAL, 500),
    (grpc.StatusCode.UNKNOWN, 500),
])
def test_status_codes_map_to_http(code, status):
    error = AttentionError.from_rpc(rpc_error(code, "prompt has 3000 tokens"), timeout_s=600)
    assert error.status == status
    assert error.code == code.name.lower()


def test_user_facing_details_pass_through_but_internal_ones_do_not():
    assert AttentionError.from_rpc(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "too long"), 1).message == "too long"
    internal = AttentionError.from_rpc(rpc_error(grpc.StatusCode.INTERNAL, "CUDA error at kernels.cu:12"), 1)
    assert "CUDA" not in internal.message
    assert "600 s" in AttentionError.from_rpc(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, ""), 600).message
