"""BodyLimit: request bodies over the limit get 413 before they are read whole, with or without a declared length."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from starlette.exceptions import HTTPException as StarletteHTTPException

from bullet_ray.serve.ingress import BodyLimit, _http_error


def _app(limit: int | None) -> tuple[FastAPI, list[int]]:
    app = FastAPI()
    app.add_middleware(BodyLimit)
    app.add_exception_handler(StarletteHTTPException, _http_error)  # the ingress's OpenAI-style errors
    if limit is not None:
        app.state.max_request_bytes = limit
    read: list[int] = []

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        body = await request.body()
        read.append(len(body))
        return {"bytes": len(body)}

    return app, read


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_read():
    app, read = _app(100)
    client = TestClient(app)
    r = client.post("/echo", content=b"x" * 101)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413 and "101 bytes" in r.json()["error"]["message"]
    assert read == []
    assert client.post("/echo", content=b"x" * 100).json() == {"bytes": 100}


def test_a_chunked_body_is_cut_off_once_past_the_limit():
    app, read = _app(100)
    client = TestClient(app)
    r = client.post("/echo", content=iter([b"x" * 60, b"x" * 60, b"x" * 60]))  # no Content-Length
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert read == []  # the route never got a body
    assert client.post("/echo", content=iter([b"x" * 50, b"x" * 50])).json() == {"bytes": 100}


def test_no_limit_set_lets_everything_through():
    app, read = _app(None)
    assert TestClient(app).post("/echo", content=b"x" * 10_000).json() == {"bytes": 10_000}
