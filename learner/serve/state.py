"""The state behind `echo-rl serve`'s routes: options, sessions, training clients (slots), samplers.

Only the event loop's thread touches these tables; the model thread only runs jobs (and sets a slot's model, a
saved sampler's weights). Every object is owned by one API key, and a key asking for another's is told "not
found" (learner.serve.futures.NotFound), as if it did not exist.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from learner.serve.checkpoints import CheckpointStore, Found, RunInfo
from learner.serve.draw_ids import DrawIds
from learner.serve.futures import Futures, ModelThread, NotFound, Ordered
from learner.serve.sampler import LocalSampler, SamplerWeights
from learner.serve.scorer import SampleScorer
from learner.serve.swarm import SwarmSampler
from learner.serve.trained_model import OwnCopy, SharedBase, TrainedModel
from learner.serve.wire import RequestError
from learner.train.devices import bound_heap_growth, resolve_device
from p2p.messages import Engine

log = logging.getLogger(__name__)

SESSION_TIMEOUT_S = 120.0  # a session not heart-beaten this long is ended (the SDK beats every 10 s; scripts
# such as the cookbook's rl_loop never close theirs, and their models would hold the key's quota)


@dataclass
class ServeOptions:
    """What `echo-rl serve` serves (echo_cli's ServeConfig fills it)."""

    models: tuple[str, ...]  # base models a client may train (learner.train.models.load_policy names)
    cache_dir: str
    device: str
    api_keys: frozenset[str]
    checkpoint_dir: str  # where save_state and named sampler weights are kept (learner.serve.checkpoints)
    max_models_per_key: int = 4
    max_full_models: int = 0  # full fine-tuning clients at once, all keys together (0: LoRA only)
    swarm_listen: str = ""  # where workers join to sample (learner.serve.swarm); "": every sample is drawn here
    swarm_dir: str = ""  # the swarm side's identity, its address file (learner.addr) and its chunks
    swarm_secret: bytes | None = None  # only workers proving it sample (p2p.auth)
    sample_seed: int = -1  # unseeded requests' draws derive from it (learner.serve.draw_ids); < 0: afresh


@dataclass
class Session:
    key: str
    seen: float = field(default_factory=time.monotonic)  # its last heartbeat (or creation)


@dataclass
class Slot:
    """A training client's model and its request order."""

    key: str
    session_id: str
    run: RunInfo  # base model, LoRA rank, output-layer adapter
    created_by: str  # the create_model request id (a retried create_model gets it again)
    model: TrainedModel | None = None  # None until create_model has run
    failed: bool = False  # create_model failed: the slot no longer counts against the key
    closed: bool = False  # its session ended: its adapters come off the shared base
    inflight: Saved | None = None  # what its "inflight" samplers sample: its latest inflight save
    order: Ordered = field(default_factory=Ordered)

    def trained(self) -> TrainedModel:
        if self.closed:
            raise RequestError("this model's session has ended")
        if self.model is None:
            raise RequestError("this model failed to load (the server's log says why); create another")
        return self.model


class Service:
    """The state behind the routes. Only the event loop's thread touches these tables; the model thread
    only runs jobs (and sets a slot's model, a sampler's weights; `shared` is its own)."""

    def __init__(self, options: ServeOptions, make_engine: Callable[[], Engine]) -> None:
        self.options = options
        bound_heap_growth()  # large blocks by mmap: freed activations go back to the OS (learner.train.devices)
        self.sessions: dict[str, Session] = {}  # session id -> its key
        self.slots: dict[str, Slot] = {}  # model id -> slot
        self.samplers: dict[str, Sampler] = {}  # sampling session id -> what it samples
        self.futures = Futures()
        self.thread = ModelThread()
        as_workers = frozenset(options.models[:1] if options.swarm_listen else ())  # (the swarm's: the first)
        self.sampler = LocalSampler(make_engine, options.cache_dir, as_workers)
        self.draw_ids = DrawIds(options.sample_seed)
        self.scorer: SampleScorer | None = None  # with a sample seed: every sample's logprobs scored alone
        if options.sample_seed >= 0:
            self.scorer = SampleScorer(options.cache_dir, as_workers, str(resolve_device(options.device)))
        self.store = CheckpointStore(options.checkpoint_dir)
        self.shared: dict[str, SharedBase] = {}  # base model -> the copy its training clients share (model thread)
        self._bases: dict[str, SamplerWeights] = {}
        self.full_samplers: deque[Saved] = deque()  # checkpoint samplers holding every weight, newest last (model
        # thread): beyond max(1, max_full_models), the oldest drop theirs (read again from the checkpoint if asked)
        self.swarm: SwarmSampler | None = None  # workers sampling the first served model, where they may join
        if options.swarm_listen:
            device = str(resolve_device(options.device))
            self.swarm = SwarmSampler(options.models[0], options.cache_dir, options.swarm_listen, options.swarm_dir,
                                      device, options.swarm_secret, alone=options.sample_seed >= 0)  # fmt: skip

    def base_weights(self, base_model: str) -> SamplerWeights:
        """A base model itself, for samplers made from it (one object: the engine need not swap between them)."""
        return self._bases.setdefault(base_model, SamplerWeights(base_model, 0, {}))

    def key_of(self, request: Request) -> str:
        key = request.headers.get("x-api-key", "")
        if key not in self.options.api_keys:
            raise PermissionError("unknown API key: set TINKER_API_KEY to a key from the server's key file")
        return key

    def session(self, key: str, session_id: str) -> Session:
        self.expire()
        session = self.sessions.get(session_id)
        if session is None or session.key != key:
            raise NotFound(f"session {session_id!r}")
        return session

    def slot(self, key: str, model_id: str) -> Slot:
        slot = self.slots.get(model_id)
        if slot is None or slot.key != key:
            raise NotFound(f"model {model_id!r}")
        return slot

    def end(self, session_id: str) -> None:
        """End a session: its models and samplers are dropped (freed once no queued job holds them); weights
        saved under a name stay."""
        self.sessions.pop(session_id, None)
        for sampler_id in [s for s, sampler in self.samplers.items() if sampler.session_id == session_id]:
            del self.samplers[sampler_id]
        for model_id in [m for m, slot in self.slots.items() if slot.session_id == session_id]:
            self.drop(self.slots.pop(model_id))
            log.info("serve: %s dropped (its session ended)", model_id)

    def drop(self, slot: Slot) -> None:
        """Free a training client's adapters, on the model thread after the jobs it has queued (those still
        waiting for an earlier seq_id start now, and fail: the session has ended)."""
        slot.closed = True
        for start in slot.order.waiting.values():
            start()
        slot.order.waiting.clear()

        def close() -> None:
            if slot.model is not None:
                slot.model.close()
                slot.model = None

        self.thread.run(slot.key, concurrent.futures.Future(), close)

    def expire(self) -> None:
        now = time.monotonic()
        for session_id in [s for s, session in self.sessions.items() if now - session.seen > SESSION_TIMEOUT_S]:
            self.end(session_id)
        for model_id in [m for m, slot in self.slots.items() if slot.failed]:
            del self.slots[model_id]

    def job(self, key: str, job: Callable[[], Any]) -> tuple[str, Callable[[], None]]:
        """A future for `key` and what starts `job` for it on the model thread (Ordered.add's `submit`)."""
        request_id, future = self.futures.submit(key)
        return request_id, lambda: self.thread.run(key, future, job)

    def open_model(
        self, key: str, session_id: str, model_seq_id: int, run: RunInfo, user_metadata: dict | None,
        restore: Callable[[TrainedModel], None] | None, result: dict,
    ) -> str:  # fmt: skip
        """A new training client `SESSION:train:SEQ` of `run` (`restore` then fills it from a checkpoint): its
        slot now, its model built on the model thread; the job's request id."""
        self.session(key, session_id)
        if not 0 <= model_seq_id < 10**9:
            raise RequestError(f"model_seq_id {model_seq_id} must be 0 to 999999999")
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.slots:
            raise RequestError(f"model {model_id} exists: the SDK numbers a session's models, each once")
        if run.base_model not in self.options.models:
            raise RequestError(f"base_model {run.base_model!r} is not served here; served: {list(self.options.models)}")
        limit = self.options.max_full_models
        if run.full and limit == 0:
            raise RequestError("full fine-tuning is off on this server (serve --max-full-models 0): ask for LoRA")
        if run.full and sum(s.run.full and not s.failed for s in self.slots.values()) >= limit:
            raise RequestError(
                f"full fine-tuning: all {limit} of the server's full fine-tuning clients are in use (serve "
                "--max-full-models; each holds a copy of the model and its optimizer): close one, or ask for LoRA"
            )
        if sum(s.key == key for s in self.slots.values()) >= self.options.max_models_per_key:
            raise RequestError(
                f"this key holds {self.options.max_models_per_key} models already (the server's limit): close a "
                "ServiceClient to free its models"
            )
        opts = self.options

        def load() -> dict:
            model = None
            try:
                if run.full:  # (its own copy of the base model, every weight trained)
                    model = TrainedModel(OwnCopy(run.base_model, opts.cache_dir, opts.device), 0)
                else:
                    if run.base_model not in self.shared:
                        self.shared[run.base_model] = SharedBase(run.base_model, opts.cache_dir, opts.device)
                    model = TrainedModel(self.shared[run.base_model], run.lora_rank, run.seed, run.head)
                if restore is not None:
                    restore(model)
                self.store.add_run(model_id, key, run, user_metadata)
            except BaseException:
                slot.failed = True
                if model is not None:
                    model.close()
                raise
            slot.model = model
            how = "full fine-tuning" if run.full else f"rank-{run.lora_rank} LoRA"
            log.info("serve: %s: %s with %s", model_id, run.base_model, how)
            return result

        request_id, start = self.job(key, load)
        slot = self.slots[model_id] = Slot(key, session_id, run, request_id)
        start()
        return request_id


@dataclass
class Saved:
    """Weights a sampler samples: in memory (None until the save job has run, or if it failed), or a checkpoint
    read on first use (on the model thread)."""

    key: str
    base_model: str
    name: str  # the weights as the client names them (learner.serve.draw_ids): no random session id in it
    weights: SamplerWeights | None = None
    found: Found | None = None
    queue: deque[Any] = field(default_factory=deque)  # its asample requests not drawn yet (sampling_routes.Draw)
    lock: threading.Lock = field(default_factory=threading.Lock)  # the queue's (event loop and model thread)


@dataclass
class Sampler:
    """A sampling session: the saved weights it samples; `model_id` is the training client whose unnamed save
    made it (those are evicted EPHEMERAL_PER_MODEL deep)."""

    key: str
    session_id: str
    saved: Saved
    model_path: str | None = None
    model_id: str | None = None
