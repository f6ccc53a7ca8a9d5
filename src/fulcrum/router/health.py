"""Background health checks: every ``health_interval_s`` each worker's ``/health`` (fed to its
circuit breaker, so a dead worker is taken out and an open breaker is probed back) and
``/metrics`` (the running / waiting gauges that ``least_load`` reads)."""

from __future__ import annotations

import asyncio
import logging

import httpx

from fulcrum.router.state import RouterState
from fulcrum.router.worker import Worker, parse_load

log = logging.getLogger("fulcrum.router")


async def check_worker(state: RouterState, client: httpx.AsyncClient, w: Worker) -> None:
    headers = {"authorization": f"Bearer {w.api_key}"} if w.api_key else {}
    timeout = httpx.Timeout(max(1.0, state.cfg.health_interval_s))
    if not w.breaker.available():
        return  # open and cooling down: no probe yet
    w.breaker.on_dispatch()
    try:
        r = await client.get(w.url + "/health", headers=headers, timeout=timeout)
        ok = r.status_code == 200
    except httpx.HTTPError:
        ok = False
    w.healthy = ok
    if not ok:
        w.breaker.record_failure()
        w.reported_running = w.reported_waiting = None
        return
    w.breaker.record_success()
    try:
        r = await client.get(w.url + "/metrics", headers=headers, timeout=timeout)
        if r.status_code == 200:
            w.reported_running, w.reported_waiting = parse_load(r.text)
    except httpx.HTTPError:
        pass  # load stays as last seen; /health decides availability


async def health_loop(state: RouterState, client: httpx.AsyncClient) -> None:
    while True:
        await asyncio.gather(
            *(check_worker(state, client, w) for w in state.workers()), return_exceptions=True
        )
        await asyncio.sleep(state.cfg.health_interval_s)
