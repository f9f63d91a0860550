"""Client library for the daemon's Unix socket: `Client` (blocking) and `AsyncClient` (asyncio)."""
from pipeline.client.aio import AsyncClient, AsyncStream
from pipeline.client.batches import BlockingStreamBatches, StreamBatches
from pipeline.client.connection import AsyncConnection, Connection
from pipeline.client.replies import Completion, Prompt, RequestReplies, StreamDelta, make_generate
from pipeline.client.sync import Client, Stream

__all__ = ["AsyncClient", "AsyncConnection", "AsyncStream", "BlockingStreamBatches", "Client", "Completion", "Connection", "Prompt",
           "RequestReplies", "Stream", "StreamBatches", "StreamDelta", "make_generate"]
