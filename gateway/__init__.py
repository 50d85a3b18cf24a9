"""The OpenAI-compatible HTTP gateway: HTTP and gRPC only (never torch), so it starts fast and runs small.

A request's way, by file: request_id.py, middleware.py -> app.py (routes) -> handlers/ (chat.py,
completions.py, models.py, ops.py: one per endpoint family) -> streams.py (its Generate calls, admitted
by admission.py) -> attention_client.py (the gRPC client: the only module that touches protobuf).
On the way: openai_types.py (the HTTP vocabulary and its conversion to attention-service requests),
attention_types.py (those requests and their answers), logprobs.py and sse.py (OpenAI's shapes and
stream framing), failures.py (a failed call as the client's error), metrics.py (Prometheus),
settings.py (the only reader of the environment).
"""
