"""The Tinker API's sampling routes: weights saved for sampling, sampling sessions, and asample.

    save_weights_for_sampler(model, path)   ->  future: {"path": tinker://MODEL/sampler_weights/PATH}
    save_weights_for_sampler(model, seq)    ->  future: {"sampling_session_id"} (what the cookbook's loops use)
    create_sampling_session(path or base)   ->  {"sampling_session_id"};  GET samplers/{id} says what it samples
    asample(session, prompt, params)        ->  future: a SampleResponse (protobuf), with one id per sample:
                                            drawn by swarm workers (learner.serve.swarm, where joined) or
                                            here, with the requests queued beside it (draw_batch)

A save runs in its training client's seq_id order and copies the adapters as they are at that point: a named
one to the checkpoint store (learner.serve.checkpoints: it outlives the session and the server), an unnamed one
in memory, listed as a sampler at once (its weights filled when the save runs: the SDK samples only once the
save's future is done). A key sees only its own samplers and saved weights. A training client's unnamed
snapshot samplers are kept EPHEMERAL_PER_MODEL deep (the cookbook makes one per step): an older one is "not
found"; its "inflight" samplers share one target, which each inflight save replaces.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tinker import types

from learner.serve.checkpoints import NAME
from learner.serve.futures import NotFound
from learner.serve.sampler import Drawn, SamplerWeights, batchable, check_request, request_tokens
from learner.serve.state import Sampler, Saved, Service
from learner.serve.wire import RequestError, parse, write_sample_response

log = logging.getLogger(__name__)

EPHEMERAL_PER_MODEL = 4  # unnamed snapshot samplers kept per training client, the newest
MAX_SAMPLERS_PER_KEY = 256


async def save_weights_for_sampler(svc: Service, key: str, body: Any) -> dict:
    req = parse(types.SaveWeightsForSamplerRequest, body)
    slot = svc.slot(key, req.model_id)
    run = slot.run
    unnamed = req.path is None and req.sampling_session_seq_id is not None
    inflight = unnamed and req.kind == "inflight"  # every inflight sampler of a client samples its latest save
    name = f"train:{req.model_id.rsplit(':', 1)[-1]}:sample:{req.sampling_session_seq_id}"  # (draw_ids)
    saved = slot.inflight if inflight and slot.inflight is not None else Saved(key, run.base_model, name)
    sampler_id = f"{slot.session_id}:sample:{req.sampling_session_seq_id}"

    def save() -> dict:  # on the model thread, in seq_id order: a refusal too keeps its place
        if req.path is None and req.sampling_session_seq_id is None:
            raise RequestError("save_weights_for_sampler: send a path, or a sampling_session_seq_id")
        if req.path is not None and not NAME.fullmatch(req.path):
            raise RequestError("save_weights_for_sampler: name the weights with 1 to 128 letters, digits, . _ or -")
        adapters = slot.trained().adapter_tensors()
        if req.path is None:
            saved.weights = SamplerWeights(run.base_model, run.lora_rank, adapters, run.full)
            return {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}
        path = svc.store.save(key, req.model_id, "sampler_weights", req.path, adapters, None, req.ttl_seconds,
                              req.user_metadata)  # fmt: skip
        return {"type": "save_weights_for_sampler", "path": path}

    def submit() -> tuple[str, Any]:  # once per seq_id (a resent request gets the first one's id)
        request_id, start = svc.job(key, save)
        if unnamed:
            if inflight:
                slot.inflight = saved
            add_sampler(svc, sampler_id, Sampler(key, slot.session_id, saved, None, None if inflight else req.model_id))
        return request_id, start

    return {"request_id": slot.order.add(req.seq_id, submit), "model_id": req.model_id}


async def create_sampling_session(svc: Service, key: str, body: Any) -> dict:
    req = parse(types.CreateSamplingSessionRequest, body)
    svc.session(key, req.session_id)
    sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
    if sampler_id not in svc.samplers:  # (else a resent request: the same answer)
        saved = saved_weights(svc, key, req.model_path, req.base_model)
        add_sampler(svc, sampler_id, Sampler(key, req.session_id, saved, req.model_path))
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


async def get_sampler(svc: Service, key: str, body: Any, sampler_id: str) -> dict:
    sampler = svc.samplers.get(sampler_id)
    if sampler is None or sampler.key != key:
        raise NotFound(f"sampler {sampler_id!r}")
    return {"sampler_id": sampler_id, "base_model": sampler.saved.base_model, "model_path": sampler.model_path}


async def asample(svc: Service, key: str, body: Any) -> dict:
    req = parse(types.SampleRequest, body)
    check_request(req)
    if req.sampling_session_id is not None:
        sampler = svc.samplers.get(req.sampling_session_id)
        if sampler is None or sampler.key != key:
            raise NotFound(f"sampler {req.sampling_session_id!r}")
        saved = sampler.saved
    else:
        saved = saved_weights(svc, key, req.model_path, req.base_model)

    request_id, future = svc.futures.submit(key)  # (a 429 here queues nothing)
    try:
        draw = svc.draw_ids.draw_id(key, saved.name, req, req.prompt.to_ints())  # its draws, wherever drawn
    except Exception as exc:  # (a bug of ours: the future must not stay open, it counts against the key)
        future.set_exception(exc)
        raise

    def here() -> None:
        sample_here(svc, key, saved, req, draw, future)

    def answer(drawn: Drawn) -> None:  # (from a swarm handler's thread: the samples a worker drew, verified)
        if svc.scorer is None:
            future.set_result(sample_response(drawn))
        else:  # (scored on the model thread, which holds the scorer)
            svc.thread.run(key, future, lambda: sample_response(scored(svc, weights, req, drawn)))

    by_workers, weights = False, saved.weights
    if svc.swarm is not None and weights is not None:
        try:  # (off the event loop: publishing a sampler's adapters takes a moment)
            by_workers = await asyncio.to_thread(svc.swarm.submit, weights, req, draw, answer, here)
        except RequestError as exc:  # (the future's error, as where the request is drawn here)
            future.set_exception(exc)
            by_workers = True
        except Exception:  # noqa: BLE001 - a bug of ours, or the swarm side stopping: drawn here
            log.exception("serve: a request could not go to the swarm; drawn here")
    if not by_workers:
        here()
    return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(req.num_samples)]}


def sample_here(svc: Service, key: str, saved: Saved, req: types.SampleRequest, draw: int, future: Future) -> None:
    """Queue `req` (draw id `draw`) for the local sampler, on the model thread (draw_batch: with the requests
    that can go with it)."""
    entry = Draw(req, draw)

    def job() -> bytes:  # on the model thread: this request, and those queued after it that can go with it
        if entry.result is None:
            draw_batch(svc, saved, entry)
        if isinstance(entry.result, BaseException):
            raise entry.result
        return sample_response(scored(svc, entry.weights, req, entry.result))

    with saved.lock:
        saved.queue.append(entry)
    svc.thread.run(key, future, job)


def scored(svc: Service, weights: SamplerWeights | None, req: types.SampleRequest, drawn: Drawn) -> Drawn:
    """`drawn` (from `weights`), its logprobs scored alone where the server has a sample seed
    (learner.serve.scorer: the same bits whichever batch, worker or tenant it was drawn beside). On the model
    thread."""
    if svc.scorer is None or weights is None:
        return drawn
    p = req.sampling_params
    return svc.scorer.score(weights, req.prompt.to_ints(), drawn, p.temperature, p.top_p)


def sample_response(drawn: Drawn) -> bytes:
    return write_sample_response([(c.tokens, c.logprobs, c.finish_reason) for c in drawn.samples],
                                 drawn.prompt_logprobs)  # fmt: skip


@dataclass(eq=False)
class Draw:
    """An asample request, its draw id (learner.serve.draw_ids) and, once drawn (perhaps in an earlier request's
    batch), its result."""

    req: types.SampleRequest
    draw: int
    result: Drawn | BaseException | None = None
    weights: SamplerWeights | None = None  # what it was drawn from (a full sampler's may be dropped from memory)


def draw_batch(svc: Service, saved: Saved, entry: Draw) -> None:
    """Draw `entry` with the requests queued on the same sampler that batchable() lets go with it (math_rl
    sends a request per trajectory: drawn together they share the engine's waves), and give each its result.
    With a sample seed each request is drawn alone: an engine's logits move in their last bits with its batch's
    layout, enough to change a token now and then, and which requests share a batch depends on timing."""
    batch, tokens = [entry], request_tokens(entry.req)
    with saved.lock:  # (the event loop appends to the queue)
        for other in saved.queue:
            if svc.options.sample_seed < 0 and other is not entry and batchable(entry.req, other.req, tokens):
                batch.append(other)
                tokens += request_tokens(other.req)
        for drawn in batch:
            saved.queue.remove(drawn)
    try:
        if saved.weights is None and saved.found is not None:
            try:
                adapters = svc.store.adapters(saved.found)
            except OSError:
                raise RequestError("asample: the sampler's checkpoint was deleted") from None
            run = saved.found.run
            saved.weights = SamplerWeights(saved.base_model, run.lora_rank, adapters, run.full)
            if run.full:  # every weight in memory: a few such samplers at once, the others read again when asked
                svc.full_samplers.append(saved)
                while len(svc.full_samplers) > max(1, svc.options.max_full_models):
                    svc.full_samplers.popleft().weights = None
        if saved.weights is None:
            raise RequestError("asample: this sampler's weights were never saved (its save_weights_for_sampler failed)")
        results: list[Any] = svc.sampler.sample_batch(saved.weights, [d.req for d in batch], [d.draw for d in batch])
    except Exception as exc:  # noqa: BLE001 - every request of the batch fails with it (logged by its own job)
        results = [exc] * len(batch)
    for drawn, result in zip(batch, results, strict=True):
        drawn.result, drawn.weights = result, saved.weights


def saved_weights(svc: Service, key: str, model_path: str | None, base_model: str | None) -> Saved:
    """The weights a sampler made from a tinker:// path or a base model samples."""
    if model_path is not None:
        found = svc.store.find(key, model_path)
        return Saved(key, found.run.base_model, f"{found.kind}:{found.folder.name}", None, found)
    if base_model not in svc.options.models:
        raise RequestError(f"base_model {base_model!r} is not served here; served: {list(svc.options.models)}")
    return Saved(key, base_model, f"base:{base_model}", svc.base_weights(base_model))


def add_sampler(svc: Service, sampler_id: str, sampler: Sampler) -> None:
    """List `sampler`; a training client's unnamed snapshot samplers beyond the newest EPHEMERAL_PER_MODEL go,
    and a key's oldest samplers beyond MAX_SAMPLERS_PER_KEY."""
    svc.samplers[sampler_id] = sampler
    if sampler.model_id is not None:
        mine = [s for s, x in svc.samplers.items() if x.model_id == sampler.model_id]
        for old in mine[:-EPHEMERAL_PER_MODEL]:  # (dicts keep insertion order: oldest first)
            del svc.samplers[old]
    keys = [s for s, x in svc.samplers.items() if x.key == sampler.key]
    for old in keys[:-MAX_SAMPLERS_PER_KEY]:
        del svc.samplers[old]
