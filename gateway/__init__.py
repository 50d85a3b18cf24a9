"""The OpenAI-compatible HTTP gateway: HTTP and gRPC only (never torch), so it starts fast and runs small.

app.py (routes, middleware), serving.py (one handler per endpoint family), openai_types.py (the
HTTP vocabulary and its conversion to attention-service requests), attention_types.py (those
requests and their answers as dataclasses), attention_client.py (the gRPC client: the only module
that touches protobuf), metrics.py (Prometheus), settings.py (the only reader of the environment).
"""
