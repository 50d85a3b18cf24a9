"""Names vulture reports as unused that are used, each group with the reason (tests/test_lint.py).

vulture matches by name only: reading `_.name` here marks every definition called `name` as used,
so an entry must stay as narrow as the reason. Functions that a decorator hands to a framework or
a table (FastAPI routes, pydantic validators, kernels/quants' `@_register`) are not listed: the
`ignore_decorators` of [tool.vulture] in pyproject.toml skip them. Not a test module: nothing runs it.
"""


class _Anything:
    def __getattr__(self, _):
        return None


_ = _Anything()

# Used only by the tests: hooks and counters they read (a name the tests use is used).
_.parse_whole  # attention_service/engine/tool_calls/base.py: the whole-reply parse the parser tests compare with
_.capture_s  # attention_service/gpu/graphs.py
_.num_lent  # attention_service/gpu/host_buffers.py
_.ref_count  # attention_service/model/block_pool.py
_.to_dense  # kernels/int4pack.py
_._set_isa  # kernels/native.py: tests run every ISA's kernels
_.get_awake_ms  # kernels/native.py: tests/kernels/test_awake.py's probe script (a string run as a child)
_.packed_bytes  # kernels/native.py
_.split_gguf  # modelfile/gguf_split.py: writes the split files the loader's tests read
_.memory_bytes  # splitmoe/runtime/topology.py

# Read by another library, by attribute name.
_.special_token_ids  # attention_service/engine/grammar.py: llguidance's TokenizerWrapper reads these three
_.eos_token_id
_.bos_token_id
_.normalizer  # modelfile/tokenizer.py, bench/structured_outputs.py: properties of a `tokenizers.Tokenizer`
_.pre_tokenizer
_.writeable  # bench/kernels_bench.py: numpy's `ndarray.flags.writeable`
_.formatter_class  # splitmoe/cli.py: argparse's
_.openapi  # gateway/docs.py: FastAPI calls `app.openapi()` for /openapi.json
_.tags  # modelfile/chat_template.py: a jinja2 Extension's tags; jinja2 calls `_body` by its name (call_method)
_._body
_.unsafe_undefined  # modelfile/chat_template.py: the jinja2 sandbox's hook
_.intercept_service  # splitmoe/runtime/cluster_auth.py: grpc's server and client interceptor methods
_.intercept_unary_unary
_.intercept_unary_stream
_.intercept_stream_unary
_.intercept_stream_stream
_.n_gpu_layers  # bench/llamacpp.py: fields of llama.cpp's ctypes parameter and batch structs
_.n_ubatch
_.n_threads
_.n_threads_batch
_.n_tokens

# Pydantic models of the OpenAI API (gateway/openai_types.py, tokenize_types.py): fields of the wire
# format, parsed from requests or written into responses' JSON, and pydantic's own configuration.
_.model_config
_.user
_.description
_.strict
_.refusal
_.reasoning_content
_.total_tokens
_.owned_by
_.max_model_len

# Dataclass fields written out by name.
_.decode16_s  # bench/driver.py: the benchmark's JSON (asdict)
_.bytes_total  # gateway/attention_types.py: gateway/metrics.py reads the hop counters by field name

# Documentation: llama.cpp's llama_token_type enum, written out whole (modelfile/tokenizer.py).
_.BYTE
