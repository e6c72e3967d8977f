"""Which random draws an asample request gets: its draw id, the `group` of p2p.draws' keys.

Every token a request samples, here or on a swarm worker, comes from u(DRAW_SEED, draw id, completion, position)
(p2p.draws, inverse CDF), so its samples depend on its draw id and the weights alone: not on where it is drawn,
nor on the batch or lease it shares with other requests, other tenants' included (up to float noise, and, on a
worker, to the few tokens the replay lets it steer: docs/security.md).

    a seeded request      H(seed): its draws are the seed's (as a seeded generator's: the same request draws the
                          same samples; with a stop or fewer tokens, those samples cut short). Drawn here only
    serve --sample-seed N H(N, sampler, prompt, params, k) for the k-th such request of an API key to that
                          sampler: a run sending the same requests draws the same samples, whatever other keys do
    otherwise             63 random bits

`sampler` names the weights as the client does (a training client's seq id and its sampler's, a checkpoint's
name, a base model), not by the server's random session ids, so two runs of one recipe name theirs alike. The
API key only picks whose counts k are used (nothing derived from it reaches a worker). Each key's counts are
kept for its newest MOST_COUNTED (sampler, prompt, params) triples: one asked again after that many others (never,
in a loop whose sampler changes each step) counts from 0 again and repeats its draws. Identical requests in
flight at once may trade their samples, and a request the client resends counts again.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from collections import OrderedDict

import numpy as np
from tinker import types

DRAW_SEED = 0  # every lease's and local draw's seed: the draw id keys the rest
MOST_COUNTED = 1 << 16  # (sampler, prompt, params) triples whose counts are kept, per API key (~11 MB)


def _digest(*parts: object, prompt: list[int]) -> bytes:
    h = hashlib.blake2b(json.dumps(parts, separators=(",", ":")).encode(), digest_size=16)
    h.update(np.asarray(prompt, dtype=np.int64).tobytes())  # (token ids are checked: 0 to 2**31 - 1)
    return h.digest()


def _params(req: types.SampleRequest) -> list[object]:
    p = req.sampling_params
    return [p.temperature, p.top_p, p.max_tokens, p.stop, req.num_samples]


class DrawIds:
    """Draw ids for asample requests (module docstring); `sample_seed` < 0: unseeded requests draw afresh."""

    def __init__(self, sample_seed: int = -1, most: int = MOST_COUNTED) -> None:
        self.sample_seed, self.most = sample_seed, most
        self._counts: dict[str, OrderedDict[bytes, int]] = {}  # API key -> its triples' counts, oldest first
        self._lock = threading.Lock()

    def draw_id(self, key: str, sampler: str, req: types.SampleRequest, prompt: list[int]) -> int:
        """The draw id of `req` (its prompt's tokens `prompt`), from API key `key` to the weights named `sampler`."""
        if req.sampling_params.seed is not None:
            return _id(_digest("seed", req.sampling_params.seed, prompt=[]))
        if self.sample_seed < 0:
            return secrets.randbits(63)
        triple = _digest(sampler, _params(req), prompt=prompt)
        with self._lock:
            counts = self._counts.setdefault(key, OrderedDict())
            k = counts.pop(triple, 0)
            counts[triple] = k + 1  # (the newest at the end)
            while len(counts) > self.most:
                counts.popitem(last=False)
        return _id(hashlib.blake2b(triple + f"{self.sample_seed}:{k}".encode(), digest_size=8).digest())


def _id(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits
