"""Anthropic's Messages wire format: the request body and its translation to a chat request (protocol.py), the
response body and the stream events (events.py)."""
