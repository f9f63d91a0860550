"""The OpenAI-compatible HTTP API's pure parts: request schemas, sampling-parameter mapping,
chat templates, response and Server-Sent-Event bodies, errors and Prometheus metrics.

Nothing here opens a socket or talks to the daemon; the HTTP server composes these.
"""
