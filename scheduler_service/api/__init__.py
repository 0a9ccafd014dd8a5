"""The public doors: the OpenAI-compatible HTTP API, request intake (public message -> Request),
security and overload answers, and the public API's Python client.
"""
