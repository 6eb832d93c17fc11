"""ASGI middleware for vLLM's OpenAI server: a 400 for an invalid kvtier ``kv_transfer_params``.

vLLM passes a request body's ``kv_transfer_params`` to the connector without
looking into it, and an engine must not fail a request it already took over a
parameter: kvtier's connector logs an invalid kvtier entry and serves the
request without control. On the served path the client hears about it instead:
this middleware reads each JSON ``POST`` body, checks its ``kv_transfer_params``
with :func:`~kvtier.offload.control.request_control`, and answers ``400`` with
the error's one line, in the OpenAI error format, before vLLM sees the request.
Every other request passes unchanged.

``kvtier serve`` loads it; with vLLM's own server, pass
``--middleware kvtier.integrations.middleware.KVTransferParamsCheck``. It
imports no vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvtier.offload.control import RequestControlError, request_control

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PARAMS_FIELD = "kv_transfer_params"
"""The body field the middleware checks."""


def _is_json_post(scope: Scope) -> bool:
    if scope["type"] != "http" or scope.get("method") != "POST":
        return False
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


def body_error(body: bytes) -> str | None:
    """The one-line error of the kvtier entry of a JSON body's ``kv_transfer_params``, if any.

    A body that is not JSON, or holds no such entry, has none: vLLM answers for the rest.
    """
    if PARAMS_FIELD.encode() not in body:
        return None
    try:
        document = json.loads(body)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    try:
        request_control(document.get(PARAMS_FIELD))
    except RequestControlError as exc:
        return str(exc)
    return None


class KVTransferParamsCheck:
    """Answers ``400`` to a JSON request whose kvtier entry of ``kv_transfer_params`` is invalid."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _is_json_post(scope):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body came
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        error = body_error(body)
        if error is not None:
            await _bad_request(send, error)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _bad_request(send: Send, message: str) -> None:
    content = json.dumps(
        {
            "error": {
                "message": message,
                "type": "BadRequestError",
                "param": PARAMS_FIELD,
                "code": 400,
            }
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(content)).encode()),
    ]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": content})
