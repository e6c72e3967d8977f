"""The Tinker API's futures: a request answers {"request_id"} at once and its result is fetched later.

    Futures.submit(key)          -> a request id and a future; 429 (Busy) while the key has too many
    ModelThread.run(key, f, job) -> job() on the one model thread: a key's jobs in order, keys in turn
    Ordered.add(seq_id, job)     -> a training client's requests run in seq_id order, each once
    Futures.result(key, id)      -> long-polls POLL_S, then "try_again"

Only the event loop's thread calls Futures; ModelThread.run is also called from the swarm side's threads
(learner.serve.swarm), which complete futures too, as the model thread does. What a key may hold is
bounded: OUTSTANDING unfinished requests (the rest get 429, which the SDK retries after a pause), results
kept KEEP_RETRIEVED_S once fetched (a poll whose answer was lost can fetch again) or KEEP_UNRETRIEVED_S if
never fetched; a key's requests never push out another key's results.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import JSONResponse, Response

from learner.serve.wire import RequestError
from learner.train.devices import give_back_freed_memory

log = logging.getLogger(__name__)

POLL_S = 25.0  # a retrieve_future waits this long for its result (the SDK's own timeout is 45 s)
OUTSTANDING = 64  # unfinished requests per key
MAX_AHEAD = 64  # how far past a model's next seq_id a request may be (it waits for the gap to fill)
KEEP_RETRIEVED_S = 60.0
KEEP_UNRETRIEVED_S = 3600.0
PROTO = "application/x-protobuf"


class NotFound(Exception):
    """A session, model or future this key does not own (or that does not exist): 404."""


class Busy(Exception):
    """The key has OUTSTANDING requests unfinished: 429, which the SDK retries after a pause."""


@dataclass
class Pending:
    """A request's future: its owner, the result (a dict for JSON, bytes for protobuf) or an exception."""

    key: str
    future: concurrent.futures.Future
    created: float = field(default_factory=time.monotonic)
    retrieved: float | None = None  # when its result was last handed out


class Futures:
    """Every key's requests and their results."""

    def __init__(self) -> None:
        self.table: dict[str, Pending] = {}  # request id -> its future
        self._ids = itertools.count(1)

    def submit(self, key: str) -> tuple[str, concurrent.futures.Future]:
        self.sweep()
        if sum(p.key == key and not p.future.done() for p in self.table.values()) >= OUTSTANDING:
            raise Busy(f"this key has {OUTSTANDING} requests unfinished; wait for their results")
        request_id = f"req-{next(self._ids)}-{secrets.token_hex(4)}"
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.table[request_id] = Pending(key, future)
        return request_id, future

    def sweep(self) -> None:
        now = time.monotonic()
        for request_id, p in list(self.table.items()):
            fetched_long_ago = p.retrieved is not None and now - p.retrieved > KEEP_RETRIEVED_S
            if p.future.done() and (fetched_long_ago or now - p.created > KEEP_UNRETRIEVED_S):
                del self.table[request_id]

    async def result(self, key: str, request_id: str) -> Response:
        pending = self.table.get(request_id)
        if pending is None or pending.key != key:
            raise NotFound(f"request {request_id!r}")
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(pending.future)), POLL_S)
        except TimeoutError:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        except RequestError as exc:
            answer: Any = {"error": str(exc), "category": "user"}
        except Exception as exc:  # noqa: BLE001 - logged where it happened
            answer = {"error": f"{type(exc).__name__}: {exc}", "category": "server"}
        else:
            answer = pending.future.result()
        pending.retrieved = time.monotonic()
        if isinstance(answer, bytes):
            return Response(answer, media_type=PROTO)
        try:  # (a non-finite number cannot be JSON: the SDK would re-poll a 500 forever)
            return Response(json.dumps(answer, allow_nan=False), media_type="application/json")
        except ValueError:
            log.error("serve: the result of %s is not finite JSON: %s", request_id, str(answer)[:200])
            return JSONResponse({"error": "the result held a number that is not finite", "category": "server"})


class ModelThread:
    """The one thread all model work runs on, a job at a time: each key's jobs in the order run() was
    called, the keys taking turns (round robin), so one key's long queue does not hold up another key."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[Callable[[], None]]] = {}  # key -> its jobs waiting, oldest first
        self.turns: deque[str] = deque()  # keys with jobs waiting, the next to run first
        self.changed = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._loop, name="serve-model", daemon=True)
        self.thread.start()

    def run(self, key: str, future: concurrent.futures.Future, job: Callable[[], Any]) -> None:
        def work() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(job())
            except RequestError as exc:
                future.set_exception(exc)
            except NotFound as exc:  # (what the job looked up is gone: the client's error too)
                future.set_exception(RequestError(f"{exc} not found"))
            except Exception as exc:  # noqa: BLE001 - a bug of ours: the client sees a server error, we log it
                log.exception("serve: a request failed")
                future.set_exception(exc)

        with self.changed:
            if key not in self.queues:
                self.queues[key] = deque()
                self.turns.append(key)
            self.queues[key].append(work)
            self.changed.notify()

    def _loop(self) -> None:
        while True:
            with self.changed:
                while not self.turns and not self.closed:
                    self.changed.wait()
                if self.closed:
                    return
                key = self.turns.popleft()
                work = self.queues[key].popleft()
                if self.queues[key]:
                    self.turns.append(key)  # its next job after every other key's next one
                else:
                    del self.queues[key]
            work()
            give_back_freed_memory()  # (a training step's activations: glibc would keep the peak for good)

    def close(self) -> None:
        """Stop after the job running now; the queued ones are dropped."""
        with self.changed:
            self.closed = True
            self.changed.notify()


@dataclass
class Ordered:
    """A training client's requests by seq_id (the SDK numbers them 1, 2, ... and may send them out of
    order): each runs once every earlier one has been handed to the model thread; one sent again gets the
    first one's request id."""

    next_seq: int = 1
    waiting: dict[int, Callable[[], None]] = field(default_factory=dict)  # seq_id -> starts its job
    seen: dict[int, str] = field(default_factory=dict)  # seq_id -> request id, for the last MAX_AHEAD

    def add(self, seq_id: int | None, submit: Callable[[], tuple[str, Callable[[], None]]]) -> str:
        """The request id of request `seq_id`; `submit()` makes its future: (request id, what starts it)."""
        if seq_id is None or seq_id < 1:
            raise RequestError("seq_id is required, from 1 up (the SDK numbers a model's requests)")
        if seq_id in self.seen:
            return self.seen[seq_id]
        if not self.next_seq <= seq_id <= self.next_seq + MAX_AHEAD:
            raise RequestError(f"seq_id {seq_id} is out of range (next is {self.next_seq})")
        request_id, start = submit()
        self.seen[seq_id] = request_id
        self.waiting[seq_id] = start
        while self.next_seq in self.waiting:
            self.waiting.pop(self.next_seq)()
            self.seen.pop(self.next_seq - MAX_AHEAD, None)
            self.next_seq += 1
        return request_id
