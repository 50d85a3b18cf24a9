"""The expert service: hosts a shard of a GGUF file's routed experts behind a gRPC stream."""
