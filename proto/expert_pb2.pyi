from splitmoe.proto import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeShardRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadShardRequest(_message.Message):
    __slots__ = ("layers", "experts", "by_layer")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    BY_LAYER_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    experts: _containers.RepeatedScalarFieldContainer[int]
    by_layer: _containers.RepeatedCompositeFieldContainer[LayerExperts]
    def __init__(self, layers: _Optional[_Iterable[int]] = ..., experts: _Optional[_Iterable[int]] = ..., by_layer: _Optional[_Iterable[_Union[LayerExperts, _Mapping]]] = ...) -> None: ...

class LayerExperts(_message.Message):
    __slots__ = ("layer", "experts")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    experts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., experts: _Optional[_Iterable[int]] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("model_name", "arch", "file_id", "layers", "experts", "hidden_size", "num_bytes", "hostname", "num_threads", "doorbell", "by_layer", "instance_id", "draining")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    FILE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_FIELD_NUMBER: _ClassVar[int]
    BY_LAYER_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    arch: str
    file_id: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    experts: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    num_bytes: int
    hostname: str
    num_threads: int
    doorbell: str
    by_layer: _containers.RepeatedCompositeFieldContainer[LayerExperts]
    instance_id: str
    draining: bool
    def __init__(self, model_name: _Optional[str] = ..., arch: _Optional[str] = ..., file_id: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., experts: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., num_bytes: _Optional[int] = ..., hostname: _Optional[str] = ..., num_threads: _Optional[int] = ..., doorbell: _Optional[str] = ..., by_layer: _Optional[_Iterable[_Union[LayerExperts, _Mapping]]] = ..., instance_id: _Optional[str] = ..., draining: _Optional[bool] = ...) -> None: ...

class ExpertRequest(_message.Message):
    __slots__ = ("step_id", "layer", "hidden", "expert_ids", "expert_weights", "trace_context", "lora")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    layer: int
    hidden: _tensor_pb2.Tensor
    expert_ids: _tensor_pb2.Tensor
    expert_weights: _tensor_pb2.Tensor
    trace_context: _containers.ScalarMap[str, str]
    lora: _containers.RepeatedCompositeFieldContainer[LoraRows]
    def __init__(self, step_id: _Optional[int] = ..., layer: _Optional[int] = ..., hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., expert_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., expert_weights: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., lora: _Optional[_Iterable[_Union[LoraRows, _Mapping]]] = ...) -> None: ...

class LoraRows(_message.Message):
    __slots__ = ("name", "path", "identity", "rows")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    identity: str
    rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., identity: _Optional[str] = ..., rows: _Optional[_Iterable[int]] = ...) -> None: ...

class ExpertResponse(_message.Message):
    __slots__ = ("step_id", "layer", "output", "compute_s", "error")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    layer: int
    output: _tensor_pb2.Tensor
    compute_s: float
    error: str
    def __init__(self, step_id: _Optional[int] = ..., layer: _Optional[int] = ..., output: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., compute_s: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class PrepareLoraRequest(_message.Message):
    __slots__ = ("name", "path", "identity")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    identity: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., identity: _Optional[str] = ...) -> None: ...

class PrepareLoraResponse(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layers: _Optional[_Iterable[int]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExpertStats(_message.Message):
    __slots__ = ("layers", "experts", "tokens", "num_requests", "compute_s_total")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_TOTAL_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    experts: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    num_requests: int
    compute_s_total: float
    def __init__(self, layers: _Optional[_Iterable[int]] = ..., experts: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ..., num_requests: _Optional[int] = ..., compute_s_total: _Optional[float] = ...) -> None: ...
