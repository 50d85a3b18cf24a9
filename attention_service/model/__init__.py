"""The model on the attention device: its weights, KV cache and forward step."""
