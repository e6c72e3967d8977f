"""The two protobuf bodies of the Tinker API, read and written with the SDK's own schema (tinker.proto).

forward_backward arrives as a `ForwardBackwardRequest` (zstd-compressed if the client was told to: echo-rl
tells it not to) and its result leaves as a `ForwardBackwardOutput`; everything else is JSON checked against
the SDK's pydantic types (learner.serve.service). A request that does not decode, or holds what echo-rl
does not train on (images, audio, 2-D or sparse inputs), is the client's error: RequestError, naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError
from tinker.proto import tinker_public_pb2 as pb

MAX_DATUMS = 4096  # datums in one request (the SDK sends at most 1024 per chunk)
MAX_TOKENS = 1 << 20  # model-input tokens in one request, all datums together


class RequestError(ValueError):
    """A request the client got wrong: answered as the SDK's "user" error, with this message."""


@dataclass
class Datum:
    """One training example: its model input tokens [N] and its per-token loss inputs, each [N]."""

    tokens: np.ndarray  # int64 [N]
    inputs: dict[str, np.ndarray]  # e.g. target_tokens (int64), weights / logprobs / advantages (float32)


@dataclass
class ForwardBackward:
    """A decoded forward_backward (or forward: forward_only) request."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    data: list[Datum]


def parse(model: type[BaseModel], body: Any) -> Any:
    """`body` (parsed JSON) as the SDK's pydantic type `model`; RequestError names the first field wrong."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "body"
        raise RequestError(f"{model.__name__}: {where}: {first['msg']}") from None


NUMPY_OF = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def parse_forward_backward(body: bytes) -> pb.ForwardBackwardRequest:
    """The protobuf message of a forward_backward body (already decompressed), not yet checked."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise RequestError(f"forward_backward: the body is not a ForwardBackwardRequest ({exc})") from None
    return msg


def read_forward_backward(msg: pb.ForwardBackwardRequest) -> ForwardBackward:
    """A parsed forward_backward request as numpy, every value bounded (RequestError names what is not)."""
    if not 0 < len(msg.data) <= MAX_DATUMS:
        raise RequestError(f"forward_backward: {len(msg.data)} datums; send 1 to {MAX_DATUMS} per request")
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():  # the SDK writes numbers to both maps, strings to v2 only
        if v.WhichOneof("value") != "number":
            raise RequestError(f"forward_backward: loss_fn_config[{k!r}] is text; only numbers are read")
        config[k] = float(v.number)
    if not all(math.isfinite(v) for v in config.values()):
        raise RequestError(f"forward_backward: loss_fn_config holds a value that is not finite: {config}")
    data, total = [], 0
    for i, datum in enumerate(msg.data):
        tokens = [_tokens(chunk, i) for chunk in datum.model_input]
        ids = np.concatenate(tokens) if tokens else np.zeros(0, np.int64)
        total += len(ids)
        if not len(ids) or total > MAX_TOKENS:
            raise RequestError(f"forward_backward: datum {i} has {len(ids)} input tokens (1 to {MAX_TOKENS} in all)")
        inputs = {name: _tensor(t, f"datum {i}'s {name}") for name, t in datum.loss_fn_inputs.items()}
        for name, x in inputs.items():
            if len(x) != len(ids):
                raise RequestError(f"forward_backward: datum {i}'s {name} has {len(x)} values for {len(ids)} tokens")
        data.append(Datum(ids, inputs))
    return ForwardBackward(msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data)


def _tokens(chunk: pb.Chunk, i: int) -> np.ndarray:
    if chunk.WhichOneof("chunk") != "encoded_text":
        raise RequestError(f"forward_backward: datum {i} has a {chunk.WhichOneof('chunk')} chunk; only text is trained")
    raw = chunk.encoded_text.tokens
    if len(raw) % 4:
        raise RequestError(f"forward_backward: datum {i}'s tokens are not int32s")
    return np.frombuffer(raw, dtype="<i4").astype(np.int64)


def _tensor(t: pb.Tensor, what: str) -> np.ndarray:
    """A dense 1-D tensor of the request as numpy (int64 or float32)."""
    dtype = NUMPY_OF.get(t.dtype)
    if t.WhichOneof("encoding") != "dense" or dtype is None or len(t.shape) > 1:
        raise RequestError(f"forward_backward: {what} must be a dense 1-D float32 or int64 tensor")
    item = np.dtype(dtype).itemsize
    if len(t.dense) % item or (t.shape and t.shape[0] * item != len(t.dense)):
        raise RequestError(f"forward_backward: {what}'s bytes do not match its shape {list(t.shape)}")
    x = np.frombuffer(t.dense, dtype=np.dtype(dtype).newbyteorder("<"))
    return x.astype(np.int64) if dtype is np.int32 else x


def write_forward_backward(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput: each datum's target logprobs (float32 [N]) in one ArrayRecord, and metrics
    (each named `name:reduction`, as the SDK combines chunks by that suffix)."""
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(logprobs))
    field = record.fields["logprobs"]
    field.dtype = pb.DTYPE_FLOAT32
    arrays = [np.ascontiguousarray(x, dtype="<f4") for x in logprobs]
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype="<i8").tobytes()
    for name, value in metrics.items():
        out.metrics[name] = float(value)
    return out.SerializeToString()


def write_sample_response(
    samples: list[tuple[list[int], list[float], str]], prompt_logprobs: list[float] | None
) -> bytes:
    """A SampleResponse: each sample's (tokens, logprobs, finish "stop" or "length"), and the prompt's logprobs
    when asked (NaN where not scored, as the SDK reads None)."""
    out = pb.SampleResponse()
    for tokens, logprobs, finish in samples:
        out.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if finish == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(logprobs, dtype="<f4").tobytes(),
        )
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype="<f4").tobytes()
    return out.SerializeToString()
