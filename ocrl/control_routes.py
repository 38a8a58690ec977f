"""/v1/ocrl/*: what the dashboard (tui/sources.py) and an operator ask of a running daemon.

    GET  /v1/ocrl/stats           the stats snapshot (ocrl/stats.py's Stats), msgspec JSON
    GET  /v1/ocrl/events          SSE: every daemon Event, recent history first, keep-alives
    POST /v1/ocrl/train/pause     pause training        (409 training_disabled without a trainer)
    POST /v1/ocrl/train/resume    resume training
    POST /v1/ocrl/checkpoint      save a checkpoint now: {"checkpoint": path | null}
    POST /v1/ocrl/detokenize      {"ids": [[int]]} -> {"texts": [str]}, for the remote sample view

The daemon's parts come in as callables and objects (`stats`, `events`, `control`); this module
knows their signatures, never the daemon itself.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ocrl.bodies import BodyReader
from ocrl.replies import ApiError, error_response, json_response
from ocrl.stats import Stats

_encoder = msgspec.json.Encoder()


class Detokenize(msgspec.Struct):
    ids: list[list[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]]]


class ControlRoutes:
    def __init__(self, bodies: BodyReader, *, stats: Callable[[], Stats | dict[str, Any]] | None = None, events=None, control=None):
        self.bodies = bodies  # reads /detokenize's body; its tokenizer decodes
        self.stats = stats or Stats
        self.events = events
        self.control = control  # .training, pause_training(), resume_training(), async save_checkpoint()

    async def ocrl_stats(self, request: Request) -> Response:
        return json_response(self.stats())

    async def ocrl_events(self, request: Request) -> Response:
        """Server-sent events: every daemon Event, msgspec JSON, recent history first."""
        if self.events is None:
            return error_response(ApiError(404, "no event stream in this process", code="not_found"))

        async def stream():
            with self.events.subscribe(replay=True) as subscription:
                yield b": ocrl events\n\n"
                while True:
                    with anyio.move_on_after(15) as idle:
                        event = await subscription.get()
                    if idle.cancelled_caught:
                        yield b": keep-alive\n\n"
                        continue
                    yield b"data: " + _encoder.encode(event) + b"\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def ocrl_detokenize(self, request: Request) -> Response:
        """Token ids -> text, for the dashboard's sample view when attached remotely."""
        try:
            body = msgspec.json.decode(await self.bodies._read_body(request), type=Detokenize)
            texts = self.bodies.tokenizer.batch_decode(body.ids, skip_special_tokens=False)
        except ApiError as e:
            return error_response(e)
        except (msgspec.DecodeError, ValueError, TypeError, OverflowError) as e:
            return error_response(ApiError(400, f"invalid request: {e}", param="ids"))
        return json_response({"texts": texts})

    def _training_control(self):
        if self.control is None or not self.control.training:
            raise ApiError(409, "training is off in this daemon (--no-train)", code="training_disabled")
        return self.control

    async def ocrl_pause(self, request: Request) -> Response:
        try:
            self._training_control().pause_training()
        except ApiError as e:
            return error_response(e)
        return json_response({"paused": True})

    async def ocrl_resume(self, request: Request) -> Response:
        try:
            self._training_control().resume_training()
        except ApiError as e:
            return error_response(e)
        return json_response({"paused": False})

    async def ocrl_checkpoint(self, request: Request) -> Response:
        try:
            path = await self._training_control().save_checkpoint()
        except ApiError as e:
            return error_response(e)
        return json_response({"checkpoint": str(path) if path else None})
