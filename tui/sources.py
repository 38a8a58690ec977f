"""Where the dashboard's data comes from: a stream of ocrl Events, a stats snapshot, and the
three things a person can ask of a running daemon (pause, resume, save a checkpoint).

`LocalSource` reads a Daemon in the same process; `RemoteSource` reads one over HTTP:

    GET  {url}/v1/ocrl/events           SSE; each `data:` line is one msgspec-JSON Event; the
                                        daemon replays its recent history, then streams live
    GET  {url}/v1/ocrl/stats            the daemon's stats snapshot (ocrl/stats.py's Stats)
    POST {url}/v1/ocrl/train/pause      pause training
    POST {url}/v1/ocrl/train/resume     resume training
    POST {url}/v1/ocrl/checkpoint       save a checkpoint now; answers {"checkpoint": str | null}
    POST {url}/v1/ocrl/detokenize       optional: {"ids": [[int]]} -> {"texts": [str]}

all with `Authorization: Bearer <key>` when a key is set. This module knows nothing about
widgets; the dashboard knows nothing about HTTP or the daemon's insides.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec

from ocrl.stats import Stats
from ocrl.types import Event, Sample

PROMPT_TAIL_TOKENS = 256  # how much of a sample's prompt the detail view shows


class SourceError(Exception):
    """The daemon could not be reached, or answered with an error."""


class ActionUnavailable(SourceError):
    """The source cannot do what was asked (training off, endpoint missing, daemon down)."""


class SampleText(msgspec.Struct):
    """The decoded end of a sample's prompt and its response, exactly as tokenised."""

    prompt_tail: str
    response: str


def split_tokens(sample: Sample) -> tuple[list[int], list[int]]:
    """(the last PROMPT_TAIL_TOKENS prompt ids, the response ids)."""
    cut = len(sample.tokens) - sample.response_length
    return sample.tokens[max(0, cut - PROMPT_TAIL_TOKENS) : cut], sample.tokens[cut:]


class Source:
    """The dashboard's one view of a daemon. Subclasses override what they can do; the defaults
    are the null behaviour (no events, empty snapshot, actions unavailable, no text)."""

    url: str = ""
    event_error: str | None = None  # why events are not arriving, when the source knows

    async def events(self) -> AsyncIterator[Event]:
        """Every event, oldest first, until cancelled."""
        await anyio.sleep_forever()
        yield  # pragma: no cover  (makes this an async generator)

    async def snapshot(self) -> Stats | dict[str, Any]:
        """The stats: a `Stats`, or its JSON decoded (the dashboard converts it)."""
        return Stats()

    async def pause(self) -> None:
        raise ActionUnavailable("this source cannot pause training")

    async def resume(self) -> None:
        raise ActionUnavailable("this source cannot resume training")

    async def save(self) -> str | None:
        """Save a checkpoint now; the path written, or None when the daemon saves nowhere."""
        raise ActionUnavailable("this source cannot save checkpoints")

    async def sample_text(self, sample: Sample) -> SampleText | None:
        """The hook for the detail view: None when the source cannot decode tokens."""
        return None

    async def aclose(self) -> None:
        pass


class LocalSource(Source):
    """A Daemon in this process, through the same controls /v1/ocrl/* uses. The subscription
    buffers (and drops the oldest when full), so a slow dashboard never stalls the daemon."""

    def __init__(self, daemon, limit: int = 10_000):
        self.daemon = daemon
        self.limit = limit
        self.url = f"http://{daemon.config.host}:{daemon.config.port}/v1"

    async def events(self) -> AsyncIterator[Event]:
        with self.daemon.events.subscribe(self.limit, replay=True) as subscription:
            async for event in subscription:
                yield event

    async def snapshot(self) -> Stats | dict[str, Any]:
        if getattr(self.daemon, "api", None) is None:  # still building: nothing to count yet
            run_dir = getattr(self.daemon, "run_dir", None)
            return Stats(run_dir=str(run_dir) if run_dir else "")
        return self.daemon.stats()

    def _control(self):
        if not self.daemon.training:
            raise ActionUnavailable("training is off in this daemon (--no-train), or not started yet")
        return self.daemon

    async def pause(self) -> None:
        self._control().pause_training()

    async def resume(self) -> None:
        self._control().resume_training()

    async def save(self) -> str | None:
        control = self._control()
        with anyio.CancelScope(shield=True):  # quitting mid-save must not leave a half checkpoint
            path = await control.save_checkpoint()
        return str(path) if path is not None else None

    async def sample_text(self, sample: Sample) -> SampleText | None:
        loaded = getattr(self.daemon, "loaded", None)
        if loaded is None:
            return None
        prompt_tail, response = split_tokens(sample)
        texts = await anyio.to_thread.run_sync(
            lambda: loaded.tokenizer.batch_decode([prompt_tail, response], skip_special_tokens=False)
        )
        return SampleText(prompt_tail=texts[0], response=texts[1])


_event_decoder = msgspec.json.Decoder(Event)


def base_url(url: str) -> str:
    """The server root, whether the user gave it with or without the trailing /v1."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The `data` of each server-sent event (multi-line data joined by newlines); comments,
    `event:`, `id:` and `retry:` fields are ignored."""
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


SAVE_TIMEOUT = 600.0
REPLAY_MEMORY = 4096  # more than the daemon's replayed history (Events.history, 500)


class _Recent:
    """Membership of the last `size` payloads seen (by hash: every event carries its own
    timestamp, so two distinct events never encode to the same bytes)."""

    def __init__(self, size: int):
        self.order: deque[int] = deque()
        self.members: set[int] = set()
        self.size = size

    def add(self, data: str) -> bool:
        """True when `data` is new."""
        key = hash(data)
        if key in self.members:
            return False
        self.members.add(key)
        self.order.append(key)
        if len(self.order) > self.size:
            self.members.discard(self.order.popleft())
        return True


class RemoteSource(Source):
    """A daemon over HTTP. The event stream reconnects on its own; the daemon replays its
    history on each connect, so events already delivered are recognised and skipped."""

    def __init__(self, url: str, api_key: str = "", *, reconnect_delay: float = 1.0, timeout: float = 10.0):
        import httpx

        self._httpx = httpx
        self.root = base_url(url)
        self.url = self.root + "/v1"
        self.reconnect_delay = reconnect_delay
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=self.root, headers=headers, timeout=timeout)
        self._can_detokenize = True

    async def events(self) -> AsyncIterator[Event]:
        httpx = self._httpx
        delay = self.reconnect_delay
        delivered = _Recent(REPLAY_MEMORY)
        while True:
            try:
                stream = self._client.stream(
                    "GET", "/v1/ocrl/events", headers={"Accept": "text/event-stream"},
                    timeout=httpx.Timeout(self._client.timeout.connect, read=None),
                )  # fmt: skip
                async with stream as reply:
                    if reply.status_code >= 400:
                        await reply.aread()
                        raise SourceError(f"event stream: HTTP {reply.status_code}: {_error_message(reply)}")
                    self.event_error, delay = None, self.reconnect_delay
                    async for data in sse_data(reply.aiter_lines()):
                        if not delivered.add(data):
                            continue  # replayed after a reconnect: the same bytes, the same event
                        try:
                            event = _event_decoder.decode(data)
                        except msgspec.DecodeError:  # a newer daemon's kind of event: skip it
                            continue
                        yield event
                self.event_error = "event stream ended: reconnecting"
            except httpx.HTTPError as e:
                self.event_error = f"event stream: {self.root} unreachable ({type(e).__name__})"
            except SourceError as e:
                self.event_error = str(e)
            await anyio.sleep(delay)
            delay = min(delay * 2, 10.0)

    async def snapshot(self) -> Stats | dict[str, Any]:
        try:
            reply = await self._client.get("/v1/ocrl/stats")
        except self._httpx.HTTPError as e:
            raise SourceError(f"{self.root} unreachable: {type(e).__name__}") from e
        if reply.status_code >= 400:
            raise SourceError(f"HTTP {reply.status_code}: {_error_message(reply)}")
        return reply.json()

    async def _post(self, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        try:
            reply = await self._client.post(path, json=body or {}, timeout=timeout or self._client.timeout)
        except self._httpx.HTTPError as e:
            raise ActionUnavailable(f"{self.root} unreachable: {type(e).__name__}") from e
        if reply.status_code >= 400:
            raise ActionUnavailable(_error_message(reply))
        return reply.json() if reply.content else {}

    async def pause(self) -> None:
        await self._post("/v1/ocrl/train/pause")

    async def resume(self) -> None:
        await self._post("/v1/ocrl/train/resume")

    async def save(self) -> str | None:
        # The daemon answers once the checkpoint is written: a big model takes a while.
        return (await self._post("/v1/ocrl/checkpoint", timeout=SAVE_TIMEOUT)).get("checkpoint")

    async def sample_text(self, sample: Sample) -> SampleText | None:
        if not self._can_detokenize:
            return None
        try:
            reply = await self._client.post("/v1/ocrl/detokenize", json={"ids": list(split_tokens(sample))})
        except self._httpx.HTTPError:
            return None
        if reply.status_code in (404, 405):
            self._can_detokenize = False  # a daemon without the endpoint: stop asking
            return None
        if reply.status_code >= 400:
            return None
        prompt_tail, response = reply.json()["texts"]
        return SampleText(prompt_tail=prompt_tail, response=response)

    async def aclose(self) -> None:
        await self._client.aclose()


def _error_message(reply) -> str:
    """The daemon's OpenAI-style error message, or the HTTP status."""
    try:
        return str(reply.json()["error"]["message"])
    except Exception:
        return f"HTTP {reply.status_code} on {reply.request.url.path}"
