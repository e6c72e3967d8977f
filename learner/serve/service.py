"""`echo-rl serve`: the Tinker API over HTTP (Starlette), for the official `tinker` SDK as client.

    client/config, create_session, heartbeat   ->  sessions, each owned by an API key (X-API-Key)
    create_model, forward_backward, optim_step ->  futures: {"request_id"} now, the result by retrieve_future
    retrieve_future                            ->  long-polls POLL_S, then answers "try_again"

A training client's requests carry seq_id (1, 2, ...) and run in seq_id order (learner.serve.futures).
They are checked when their turn comes, so a refused one still takes its seq_id. All model work runs on one
thread, one request at a time, the keys taking turns (futures.ModelThread): the learner's device is one.
A session ends when its client closes it or stops heart-beating for 2 minutes; its models go with it
(learner.serve.state). Sampling: learner.serve.sampling_routes; checkpoints: learner.serve.checkpoint_routes.
JSON bodies are checked against the SDK's own pydantic types; the two protobuf ones are in
learner.serve.wire. A key sees only its own sessions, models and futures (anyone else's are "not found").
What the client got wrong is a 400 (or a future's "user" error) naming it, never a 500: the SDK retries
5xx, and an error inside a future is final for its training client; too much at once is a 429.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import zstandard
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from tinker import types

from learner.serve.checkpoint_routes import (
    delete_checkpoint,
    get_training_run,
    list_checkpoints,
    list_training_runs,
    list_user_checkpoints,
    load_weights,
    save_weights,
    weights_info,
)
from learner.serve.checkpoints import RunInfo
from learner.serve.futures import Busy, NotFound
from learner.serve.sampling_routes import (
    asample,
    create_sampling_session,
    get_sampler,
    save_weights_for_sampler,
)
from learner.serve.state import ServeOptions, Service, Session
from learner.serve.wire import (
    RequestError,
    parse,
    parse_forward_backward,
    read_forward_backward,
    write_forward_backward,
)
from p2p.messages import Engine

log = logging.getLogger(__name__)

MAX_JSON = 1 << 20  # bytes of a JSON body
MAX_PROTO = 16 << 20  # bytes of a forward_backward body, decompressed (the SDK sends chunks of ~5 MB at most)
MAX_LORA_RANK = 256
MAX_SESSIONS_PER_KEY = 64


# -- routes


async def client_config(svc: Service, key: str, body: Any) -> dict:
    # plain httpx (not pyqwest), forward_backward uncompressed, futures polled one by one
    return {"use_pyqwest_transport": False, "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False}


async def dynamic_config(svc: Service, key: str, body: Any) -> dict:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}  # (asked for again every 5 minutes)


async def create_session(svc: Service, key: str, body: Any) -> dict:
    parse(types.CreateSessionRequest, body)
    svc.expire()
    if sum(s.key == key for s in svc.sessions.values()) >= MAX_SESSIONS_PER_KEY:
        raise Busy(f"this key has {MAX_SESSIONS_PER_KEY} live sessions; close some (ServiceClient.close)")
    session_id = f"sess-{secrets.token_hex(8)}"
    svc.sessions[session_id] = Session(key)
    return {"type": "create_session", "session_id": session_id}


async def session_heartbeat(svc: Service, key: str, body: Any) -> dict:
    svc.session(key, parse(types.SessionHeartbeatRequest, body).session_id).seen = time.monotonic()
    return {"type": "session_heartbeat"}


async def create_model(svc: Service, key: str, body: Any) -> dict:
    req = parse(types.CreateModelRequest, body)
    model_id = f"{req.session_id}:train:{req.model_seq_id}"
    if (slot := svc.slots.get(model_id)) is not None and slot.key == key:  # a resent POST: the first's future
        return {"request_id": slot.created_by, "model_id": model_id}
    lora = req.lora_config
    full = lora is None or lora.rank == 0  # full fine-tuning (the SDK always sends a lora_config: rank 0 asks it)
    if not full and (not 1 <= lora.rank <= MAX_LORA_RANK or not (lora.train_mlp and lora.train_attn)):
        raise RequestError(f"lora_config: echo-rl trains ranks 1 to {MAX_LORA_RANK} with train_mlp and train_attn, "
                           "or every weight (rank 0)")  # fmt: skip
    if req.optimizer_config.type != "adamw":
        raise RequestError(f"optimizer {req.optimizer_config.type!r}: echo-rl serves adamw only")
    run = RunInfo(req.base_model, 0, True) if full else RunInfo(req.base_model, lora.rank, lora.train_unembed,
                                                                lora.seed or 0)  # fmt: skip
    request_id = svc.open_model(key, req.session_id, req.model_seq_id, run, req.user_metadata, None,
                                 {"type": "create_model", "model_id": model_id})  # fmt: skip
    return {"request_id": request_id, "model_id": model_id}


async def get_info(svc: Service, key: str, body: Any) -> dict:
    req = parse(types.GetInfoRequest, body)
    slot = svc.slot(key, req.model_id)
    base_model = slot.run.base_model
    data = {"arch": "unknown", "model_name": base_model, "tokenizer_id": base_model}
    if slot.model is not None:
        data |= {"arch": slot.model.model.config.model_type, "tokenizer_id": slot.model.tokenizer_id}
    return {"type": "get_info", "model_id": req.model_id, "model_data": data, **slot.run.lora_fields(),
            "model_name": base_model}  # fmt: skip


async def optim_step(svc: Service, key: str, body: Any) -> dict:
    req = parse(types.OptimStepRequest, body)
    slot = svc.slot(key, req.model_id)

    def step() -> dict:  # checked here, in seq_id order: a refusal takes its seq_id, leaving no gap
        adam = req.optim_params
        if not isinstance(adam, types.AdamParams):
            raise RequestError("optim_step: echo-rl serves adamw only (send adam_params)")
        ok = all(math.isfinite(v) for v in adam.model_dump().values()) and 0 <= adam.learning_rate <= 1
        ok = ok and 0 <= adam.beta1 < 1 and 0 <= adam.beta2 < 1 and 0 < adam.eps < 1
        if not (ok and 0 <= adam.weight_decay <= 1 and adam.grad_clip_norm >= 0):
            raise RequestError(f"adam_params out of range: {adam.model_dump()}")
        betas = (adam.beta1, adam.beta2)
        metrics = slot.trained().optim_step(adam.learning_rate, betas, adam.eps, adam.weight_decay, adam.grad_clip_norm)
        return {"type": "optim_step", "metrics": metrics}

    return {"request_id": slot.order.add(req.seq_id, lambda: svc.job(key, step)), "model_id": req.model_id}


async def forward_backward(svc: Service, key: str, raw: bytes) -> dict:
    msg = parse_forward_backward(raw)
    slot = svc.slot(key, msg.model_id)

    def run() -> bytes:  # checked on the model thread, in seq_id order (off the event loop; no gap on refusal)
        return write_forward_backward(*slot.trained().forward_backward(read_forward_backward(msg)))

    return {"request_id": slot.order.add(msg.seq_id, lambda: svc.job(key, run)), "model_id": msg.model_id}


async def retrieve_future(svc: Service, key: str, body: Any) -> Response:
    return await svc.futures.result(key, parse(types.FutureRetrieveRequest, body).request_id)


async def telemetry(svc: Service, key: str, body: Any) -> dict:
    return {"status": "accepted"}  # the SDK's usage events: not kept


async def finish_session(svc: Service, key: str, body: Any, session_id: str) -> dict:
    svc.session(key, session_id)
    svc.end(session_id)
    return {}


def make_app(options: ServeOptions, make_engine: Callable[[], Engine]) -> Starlette:
    """The ASGI app serving `options`, sampling with engines `make_engine` builds (worker.engines)."""
    svc = Service(options, make_engine)

    def route(path: str, handler: Callable, method: str = "POST", raw: bool = False) -> Route:
        async def endpoint(request: Request) -> Response:
            try:
                key = svc.key_of(request)
                body = await read_body(request, MAX_PROTO if raw else MAX_JSON)
                args = [body] if raw else [_json(body) if method == "POST" else dict(request.query_params)]
                out = await handler(svc, key, *args, **request.path_params)
                return out if isinstance(out, Response) else JSONResponse(out)
            except PermissionError as exc:
                return refused(request, 401, str(exc))
            except NotFound as exc:
                return refused(request, 404, f"{exc} not found")
            except RequestError as exc:
                return refused(request, 400, str(exc))
            except Busy as exc:
                return JSONResponse({"detail": str(exc)}, status_code=429)  # (the SDK retries: not logged)

        return Route(path, endpoint, methods=[method])

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def capabilities(request: Request) -> Response:
        models = [{"model_name": m, "trainable": True, "sampleable": True} for m in options.models]
        return JSONResponse({"supported_models": models})

    api = "/api/v1"
    routes = [
        route(f"{api}/client/config", client_config),
        route(f"{api}/client/dynamic_config", dynamic_config),
        route(f"{api}/create_session", create_session),
        route(f"{api}/session_heartbeat", session_heartbeat),
        route(f"{api}/sessions/{{session_id}}/finish", finish_session),
        route(f"{api}/telemetry", telemetry),
        route(f"{api}/create_model", create_model),
        route(f"{api}/get_info", get_info),
        route(f"{api}/forward_backward", forward_backward, raw=True),
        route(f"{api}/optim_step", optim_step),
        route(f"{api}/retrieve_future", retrieve_future),
        route(f"{api}/save_weights_for_sampler", save_weights_for_sampler),
        route(f"{api}/create_sampling_session", create_sampling_session),
        route(f"{api}/samplers/{{sampler_id}}", get_sampler, method="GET"),
        route(f"{api}/asample", asample),
        route(f"{api}/save_weights", save_weights),
        route(f"{api}/load_weights", load_weights),
        route(f"{api}/weights_info", weights_info),
        route(f"{api}/training_runs", list_training_runs, method="GET"),
        route(f"{api}/training_runs/{{run_id}}", get_training_run, method="GET"),
        route(f"{api}/training_runs/{{run_id}}/checkpoints", list_checkpoints, method="GET"),
        route(f"{api}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}", delete_checkpoint, method="DELETE"),
        route(f"{api}/checkpoints", list_user_checkpoints, method="GET"),
        Route(f"{api}/healthz", healthz),
        Route(f"{api}/get_server_capabilities", capabilities),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        if svc.swarm is not None:
            svc.swarm.close()
        svc.thread.close()  # queued jobs are dropped on the way out (their clients see the server gone)

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.service = svc
    return app


def refused(request: Request, status: int, detail: str) -> Response:
    """The SDK's error shape, logged in one line."""
    log.info("serve: %d %s: %s", status, request.url.path.removeprefix("/api/v1/"), detail)
    return JSONResponse({"detail": detail}, status_code=status)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, zstd-decompressed when the client says so, at most `limit` bytes either way (read from the
    stream: a zstd frame's declared size is the sender's word)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"the body exceeds {limit >> 20} MiB")
        chunks.append(chunk)
    body = b"".join(chunks)
    if request.headers.get("content-encoding", "").lower() == "zstd":
        try:
            body = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)).read(limit + 1)
        except zstandard.ZstdError as exc:
            raise RequestError(f"the zstd body does not decompress: {exc}") from None
        if len(body) > limit:
            raise RequestError(f"the body exceeds {limit >> 20} MiB decompressed")
    return body


def _json(body: bytes) -> Any:
    try:
        return json.loads(body or b"{}")
    except (ValueError, RecursionError):
        raise RequestError("the body is not JSON (or nests too deep)") from None
