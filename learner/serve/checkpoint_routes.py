"""The Tinker API's checkpoint routes: save_state, load_state, and the REST calls that list what was saved.

    save_weights(model, NAME)              ->  future: {"path": tinker://MODEL/weights/NAME} (adapters + AdamW)
    load_weights(session, seq, path)       ->  future: a new training client from a checkpoint (create form)
    load_weights(model, seq_id, path)      ->  future: a checkpoint put back into a training client
    weights_info, training_runs[/{id}[/checkpoints]], checkpoints, DELETE a checkpoint

Saves and loads into a training client run in its seq_id order (learner.serve.futures.Ordered); the files
are read and written on the model thread, by learner.serve.checkpoints.CheckpointStore.
"""

from __future__ import annotations

from typing import Any

from tinker import types

from learner.serve.checkpoints import NAME, Found, RunInfo, iso
from learner.serve.futures import NotFound
from learner.serve.state import Service
from learner.serve.trained_model import TrainedModel
from learner.serve.wire import RequestError, parse

MAX_LISTED = 1000  # items of one list call (limit)


async def save_weights(svc: Service, key: str, body: Any) -> dict:
    req = parse(types.SaveWeightsRequest, body)
    slot = svc.slot(key, req.model_id)

    def save() -> dict:  # on the model thread, in seq_id order: a refusal too keeps its place
        if req.path is None or not NAME.fullmatch(req.path):
            raise RequestError("save_state: name the checkpoint with 1 to 128 letters, digits, . _ or -")
        model = slot.trained()
        path = svc.store.save(key, req.model_id, "weights", req.path, model.adapter_tensors(), model.optimizer_state(),
                              req.ttl_seconds, req.user_metadata, req.overwrite)  # fmt: skip
        return {"type": "save_weights", "path": path}

    return {"request_id": slot.order.add(req.seq_id, lambda: svc.job(key, save)), "model_id": req.model_id}


async def load_weights(svc: Service, key: str, body: Any) -> dict:
    req = parse(types.LoadWeightsRequest, body)

    def checkpoint() -> Found:
        found = svc.store.find(key, req.path)
        if req.optimizer and found.kind != "weights":
            raise RequestError("load_weights: a sampler checkpoint holds no optimizer state; load it with "
                               "optimizer=False")  # fmt: skip
        if req.base_model is not None and req.base_model != found.run.base_model:
            raise RequestError(f"load_weights: the checkpoint is of {found.run.base_model!r}, not {req.base_model!r}")
        return found

    def restore(model: TrainedModel, found: Found) -> None:  # on the model thread
        try:
            adapters = svc.store.adapters(found)
            optimizer = svc.store.optimizer(found) if req.optimizer else None
        except OSError:
            raise RequestError(f"load_weights: checkpoint {req.path} was deleted") from None
        model.restore(adapters, optimizer)

    if req.session_id is not None:  # create form: a new training client, the checkpoint's run
        if req.model_seq_id is None:
            raise RequestError("load_weights: session_id needs model_seq_id")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        result = {"type": "load_weights", "path": req.path, "model_id": model_id}
        if (slot := svc.slots.get(model_id)) is not None and slot.key == key:  # a resent POST
            return {"request_id": slot.created_by, "model_id": model_id}
        found = checkpoint()
        request_id = svc.open_model(key, req.session_id, req.model_seq_id, found.run, req.user_metadata,
                                    lambda model: restore(model, found), result)  # fmt: skip
        return {"request_id": request_id, "model_id": model_id}
    if req.model_id is None:
        raise RequestError("load_weights: send session_id and model_seq_id, or model_id and seq_id")
    slot = svc.slot(key, req.model_id)

    def load() -> dict:  # on the model thread, in seq_id order: a refusal too keeps its place
        try:
            found = checkpoint()
        except NotFound as exc:
            raise RequestError(f"load_weights: {exc} not found") from None
        if fits(found.run) != fits(slot.run):
            raise RequestError(f"load_weights: the checkpoint's model ({found.run}) is not this client's ({slot.run})")
        restore(slot.trained(), found)
        return {"type": "load_weights", "path": req.path}

    return {"request_id": slot.order.add(req.seq_id, lambda: svc.job(key, load)), "model_id": req.model_id}


def fits(run: RunInfo) -> tuple:
    """What must match for a checkpoint to load into a training client (the seed only drew the first A)."""
    return run.base_model, run.lora_rank, run.head


async def weights_info(svc: Service, key: str, body: Any) -> dict:
    path = body.get("tinker_path") if isinstance(body, dict) else None
    if not isinstance(path, str):
        raise RequestError("weights_info: send tinker_path")
    run = svc.store.find(key, path).run
    return {"base_model": run.base_model, **run.lora_fields(), "train_unembed": run.head,
            "train_mlp": True, "train_attn": True}  # fmt: skip


async def get_training_run(svc: Service, key: str, body: Any, run_id: str) -> dict:
    return training_run(svc, key, run_id, svc.store.run_record(key, run_id))


async def list_training_runs(svc: Service, key: str, query: dict) -> dict:
    runs = svc.store.runs(key)
    offset, limit = page(query)
    return {"training_runs": [training_run(svc, key, rid, record) for rid, record in runs[offset : offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}  # fmt: skip


async def list_checkpoints(svc: Service, key: str, body: Any, run_id: str) -> dict:
    svc.store.run_record(key, run_id)
    return {"checkpoints": svc.store.checkpoints(key, run_id)}


async def list_user_checkpoints(svc: Service, key: str, query: dict) -> dict:
    checkpoints = svc.store.checkpoints(key)
    offset, limit = page(query)
    return {"checkpoints": checkpoints[offset : offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(checkpoints)}}  # fmt: skip


async def delete_checkpoint(svc: Service, key: str, body: Any, run_id: str, checkpoint_id: str) -> dict:
    svc.store.delete(key, f"tinker://{run_id}/{checkpoint_id}")
    return {}


def training_run(svc: Service, key: str, run_id: str, record: dict) -> dict:
    """The SDK's TrainingRun of a run.json."""
    run = RunInfo(**record["run"])
    mine = svc.store.checkpoints(key, run_id)
    last = {kind: next((c for c in mine if c["checkpoint_type"] == kind), None) for kind in ("training", "sampler")}
    return {"training_run_id": run_id, "base_model": run.base_model, "model_owner": record["owner"],
            **run.lora_fields(), "corrupted": False, "last_request_time": iso(record["created"]),
            "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
            "user_metadata": record.get("user_metadata")}  # fmt: skip


def page(query: dict) -> tuple[int, int]:
    try:
        offset, limit = int(query.get("offset", 0)), int(query.get("limit", 20))
    except ValueError:
        raise RequestError("offset and limit must be integers") from None
    if offset < 0 or not 1 <= limit <= MAX_LISTED:
        raise RequestError(f"offset must be >= 0 and limit 1 to {MAX_LISTED}")
    return offset, limit
