"""The ASGI middleware that answers 400 to an invalid kvtier entry of ``kv_transfer_params``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kvtier.integrations.middleware import KVTransferParamsCheck

JSON = [(b"content-type", b"application/json")]


def call(body: bytes, *, method: str = "POST", headers: Any = JSON) -> tuple[list[Any], Any]:
    """Send ``body`` in two chunks through the middleware; return what it sent and what the
    app under it received (``None`` when it was not called)."""
    chunks = [
        {"type": "http.request", "body": body[:5], "more_body": True},
        {"type": "http.request", "body": body[5:], "more_body": False},
    ]
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message["body"], message["more_body"]
        seen["body"] = body
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def receive() -> Any:
        return chunks.pop(0)

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": "/v1/completions", "headers": headers}
    asyncio.run(KVTransferParamsCheck(app)(scope, receive, send))
    return sent, seen.get("body")


def test_an_invalid_kvtier_entry_is_a_400_with_its_one_line() -> None:
    body = json.dumps({"prompt": "hi", "kv_transfer_params": {"kvtier": {"pin_s": -1}}}).encode()
    sent, passed = call(body, headers=[(b"Content-Type", b"application/json; charset=utf-8")])
    assert passed is None
    assert sent[0]["status"] == 400
    error = json.loads(sent[1]["body"])["error"]
    assert error == {
        "message": "kv_transfer_params: kvtier.pin_s: Input should be greater than 0 (got -1)",
        "type": "BadRequestError",
        "param": "kv_transfer_params",
        "code": 400,
    }


def test_everything_else_reaches_the_app_with_its_body_whole() -> None:
    valid = json.dumps({"prompt": "hi", "kv_transfer_params": {"kvtier": {"load": False}}})
    for body, kwargs in [
        (valid.encode(), {}),
        (b'{"prompt": "hi", "kv_transfer_params": {"other": 1}}', {}),
        (b'{"prompt": "no kv_transfer_params here"', {}),
        (b'["kv_transfer_params"]', {}),
        (b'{"kv_transfer_params": {"kvtier": 3}}', {"method": "GET"}),
        (b'{"kv_transfer_params": {"kvtier": 3}}', {"headers": []}),
    ]:
        sent, passed = call(body, **kwargs)
        assert passed == body and sent[0]["status"] == 200, body
