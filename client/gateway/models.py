"""Which models the broker's workers serve, asked with STATUS at most once a second and shared by every request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from client.aio import AsyncClient
from client.errors import ClientError
from client.gateway.errors import model_not_found, no_worker
from client.results import WorkerInfo

log = structlog.get_logger()

FRESH_S = 1.0  # a status this recent answers without asking again
STATUS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Served:
    workers: tuple[WorkerInfo, ...]
    at: float  # time.monotonic() of the answer
    error: str = ""  # the broker did not answer: why

    @property
    def models(self) -> list[str]:
        return sorted({w.model for w in self.workers})

    def max_context(self, model: str) -> int:
        """The tokens a conversation with `model` can hold on any of its workers (the least of theirs; 0: unknown)."""
        known = [w.max_context for w in self.workers if w.model == model and w.max_context > 0]
        return min(known, default=0)

    def sampling_defaults(self, model: str) -> Mapping[str, float | int]:
        """`model`'s recommended sampling as its workers announce it (their generation_config.json): {} when they
        recommend none, or when they disagree (workers of two configs, in a rollout say: none is used until they
        agree)."""
        seen = self.recommendations(model)
        return dict(seen.pop()) if len(seen) == 1 else {}

    def recommendations(self, model: str) -> set[tuple[tuple[str, float | int], ...]]:
        """The distinct recommended samplings of `model`'s workers."""
        return {tuple(sorted(w.sampling_defaults.items())) for w in self.workers if w.model == model}

    def renders_tools(self, model: str) -> bool:
        """Whether every worker of `model` that takes new sessions (or every one, where all drain) says it renders
        tools, function calls and reasoning (an older one, or any behind an older broker, which drops those fields,
        does not)."""
        workers = [w for w in self.workers if w.model == model]
        live = [w for w in workers if not w.draining] or workers
        return bool(live) and all(w.tools for w in live)

    def ready(self) -> tuple[bool, str]:
        if self.error:
            return False, f"the broker does not answer: {self.error}"
        live = [w for w in self.workers if not w.draining]
        if not live:
            return False, "no worker is registered with the broker" if not self.workers else "every worker is draining"
        return True, f"ready: {len(live)} worker(s) serving {', '.join(sorted({w.model for w in live}))}"


class Models:
    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.last = Served((), 0.0, "not asked yet")
        self._asking: asyncio.Task[Served] | None = None
        self._split: set[str] = set()  # models whose workers recommend different samplings (warned of)

    async def served(self, fresh: bool = False) -> Served:
        """The broker's workers, from a status at most FRESH_S old (fresh: asked now); concurrent callers share one
        question."""
        if not fresh and time.monotonic() - self.last.at < FRESH_S and not self.last.error:
            return self.last
        if self._asking is None or self._asking.done():
            self._asking = asyncio.get_running_loop().create_task(self._ask())
        return await asyncio.shield(self._asking)

    async def _ask(self) -> Served:
        try:
            workers = await self.client.status(timeout=STATUS_TIMEOUT_S)
            self.last = Served(tuple(workers), time.monotonic())
            self._check_recommendations()
        except ClientError as e:
            log.warning("broker_status_failed", error=str(e), code=e.code)
            self.last = Served((), time.monotonic(), str(e))
        return self.last

    async def sampling_defaults(self, model: str) -> Mapping[str, float | int]:
        """`model`'s recommended sampling (Served.sampling_defaults), once `check` passed it (so from the last status,
        which lists it: no question of its own on a request's path)."""
        await self.check(model)
        return self.last.sampling_defaults(model)

    def _check_recommendations(self) -> None:
        """Warn, once each time it starts, that a model's workers recommend different samplings."""
        split = {m for m in self.last.models if len(self.last.recommendations(m)) > 1}
        for model in sorted(split - self._split):
            log.warning("sampling_defaults_disagree", model=model,
                        workers={w.name: dict(w.sampling_defaults) for w in self.last.workers if w.model == model},
                        using="the API's own defaults")
        self._split = split

    async def check(self, model: str) -> None:
        """ApiError unless a live worker serves `model`: 404 when others are served, 503 when none is up. A model the
        last status lists passes at once (a stale status is asked again in the background, never on a request's path:
        a worker that went away since answers its own error)."""
        if model in self.last.models and not self.last.error:
            if time.monotonic() - self.last.at >= FRESH_S and (self._asking is None or self._asking.done()):
                self._asking = asyncio.get_running_loop().create_task(self._ask())
            return
        served = await self.served()
        if model in served.models:
            return
        served = await self.served(fresh=True)
        if model in served.models:
            return
        if served.error:
            raise no_worker(f"the broker does not answer: {served.error}")
        if not served.workers:
            raise no_worker("no worker is registered with the broker")
        raise model_not_found(model, served.models)
