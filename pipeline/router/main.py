"""`pipeline router`: serves the router's HTTP API until SIGTERM or SIGINT."""
from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import aiohttp
import uvloop

from pipeline.router.app import RouterApi
from pipeline.router.metrics import RouterMetrics
from pipeline.router.pace import StallRule
from pipeline.router.policy import Policy, Router
from pipeline.router.prefix import PrefixKeyer
from pipeline.router.replicas import Replicas
from pipeline.serve.http import HttpListener, bind

log = logging.getLogger("pipeline.router")


@dataclass(slots=True)
class RouterConfig:
    backends: list[str]
    model: str  # the replicas' checkpoint directory: its tokenizer and chat template key the prompts
    host: str = "127.0.0.1"
    port: int = 8000
    policy: Policy = Policy.PREFIX
    epsilon: float = 0.25  # a replica over (1 + epsilon) x the mean outstanding requests is passed over
    block_size: int = 16  # the replicas' --block-size
    prefix_blocks: int = 4  # leading full blocks that make a prompt's key
    health_interval_s: float = 0.5
    health_timeout_s: float = 2.0
    stall_timeout_s: float = 30.0  # the least time a replica under a silent stream has to show a sign of life (stall.py)

    def __post_init__(self) -> None:
        StallRule(self.stall_timeout_s)  # a ValueError naming a bad one


async def serve(config: RouterConfig) -> None:
    """Serves until SIGTERM or SIGINT (or until cancelled)."""
    keyer = PrefixKeyer(config.model, config.block_size, config.prefix_blocks)
    holder: list[Router] = []
    replicas = Replicas(config.backends, lambda url, healthy: holder[0].on_change(url, healthy),
                        interval_s=config.health_interval_s, timeout_s=config.health_timeout_s)
    router = Router(replicas, config.policy, config.epsilon)
    holder.append(router)
    metrics = RouterMetrics(list(replicas.by_url))
    sock = bind(config.host, config.port)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        await replicas.check_all(session)
        replicas.start(session)
        listener = HttpListener(RouterApi(session, router, keyer, metrics, config.stall_timeout_s).app(), sock)
        await listener.start()
        print(f"router listening on {listener.url} in front of {len(config.backends)} backends "
              f"({len(replicas.healthy())} healthy), policy {config.policy.value}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        try:
            await stop.wait()
        finally:
            await replicas.stop()
            await listener.stop()


def run(config: RouterConfig) -> int:
    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(serve(config))
    finally:
        loop.close()
    return 0
