"""The handlers: one object per endpoint family, each returning an error, a response, or a stream.

A handler turns a validated request into attention-service calls (through `AttentionClient`) and
their answers into OpenAI's shapes. User and service errors come back as `ErrorResponse` values;
app.py maps the three outcomes to HTTP. Streams open before the HTTP status is sent, so a request
the attention service rejects (prompt too long, queue full) gets its 4xx instead of a broken 200.
A request is admitted whole before any call (admission.py), and a failed request logs one line.
"""
