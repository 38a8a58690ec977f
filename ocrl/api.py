"""The OpenAI-compatible HTTP surface, put together: which route answers what, who may ask, and
the server's own routes (/healthz, /v1/models). The rest lives by concept:

    pipeline.py        receive -> generate -> keep, shared by every generating route
    bodies.py          reading a body: its size limit, the hopeless-body check, off-loop decoding
    chat_request.py    the chat request's Structs and validation
    chat_route.py      POST /v1/chat/completions (+SSE)
    responses.py       POST /v1/responses, GET /v1/responses/{id}
    completions.py     POST /v1/completions
    control_routes.py  /v1/ocrl/* (stats, events, training controls, detokenize)
    replies.py         JSON answers and OpenAI's error shape
    access_log.py      one log line per request, refusals counted by reason

Every request passes the request log, then the browser guard (guard.py: a foreign Host or
Origin is a 403) and the API key (401), then its route. Every failure answers in OpenAI's error
shape and changes nothing else. The API never judges or trains.
"""

from __future__ import annotations

import hmac
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ocrl import guard
from ocrl.access_log import RequestLog
from ocrl.chat_route import ChatCompletions
from ocrl.completions import Completions
from ocrl.control_routes import ControlRoutes
from ocrl.pipeline import Pipeline
from ocrl.replies import ApiError, error_response, json_response
from ocrl.responses import Responses


class Api(Pipeline):
    """The ASGI app: the shared pipeline (Pipeline) with every route mounted on it."""

    def __init__(self, config, engine, tokenizer, sessions, *, stats=None, events=None, control=None):
        super().__init__(config, engine, tokenizer, sessions)
        self.started = time.time()
        chat = ChatCompletions(self)
        responses = Responses(self)
        completions = Completions(self)
        ocrl = ControlRoutes(self, stats=stats, events=events, control=control)
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", chat.create, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                Route("/v1/responses", responses.create, methods=["POST"]),
                Route("/v1/completions", completions.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
                Route("/healthz", self.healthz, methods=["GET"]),
                Route("/v1/ocrl/stats", ocrl.ocrl_stats, methods=["GET"]),
                Route("/v1/ocrl/events", ocrl.ocrl_events, methods=["GET"]),
                Route("/v1/ocrl/train/pause", ocrl.ocrl_pause, methods=["POST"]),
                Route("/v1/ocrl/train/resume", ocrl.ocrl_resume, methods=["POST"]),
                Route("/v1/ocrl/checkpoint", ocrl.ocrl_checkpoint, methods=["POST"]),
                Route("/v1/ocrl/detokenize", ocrl.ocrl_detokenize, methods=["POST"]),
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )
        self.request_log = RequestLog(self._authorised)

    async def __call__(self, scope, receive, send):
        await self.request_log(scope, receive, send)

    async def _authorised(self, scope, receive, send):
        if scope["type"] == "http" and (refused := guard.browser_refusal(scope, self.config)) is not None:
            await error_response(refused)(scope, receive, send)
            return
        if scope["type"] == "http" and self.config.api_key and scope["path"] != "/healthz":
            auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            token = auth[7:] if auth.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.config.api_key.encode()):
                error = ApiError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _not_found(self, request: Request, exc) -> Response:
        return error_response(ApiError(404, f"no route {request.url.path}", code="not_found"))

    async def _not_allowed(self, request: Request, exc) -> Response:
        return error_response(ApiError(405, f"{request.method} not allowed on {request.url.path}"))

    # -- the server's own routes --------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        return json_response({"status": "ok", "model": self.served_name, "weights_version": self.engine.weights_version})

    def _model_card(self) -> dict:
        return {"id": self.served_name, "object": "model", "created": int(self.started), "owned_by": "ocrl"}

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != self.served_name:
            return error_response(ApiError(404, f"the model {model_id!r} does not exist; this server serves {self.served_name!r}", param="model", code="model_not_found"))
        return json_response(self._model_card())
