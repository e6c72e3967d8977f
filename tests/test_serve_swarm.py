"""`echo-rl serve --swarm-listen`: asample requests drawn by swarm workers, verified (learner/serve/swarm.py).

One test runs the real thing (the SDK, a `worker join` process); the others call the swarm side's handlers as
a worker would, with completions an in-process engine drew honestly, then forged."""

import json
import os
import secrets
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from learner.serve import sample_queue  # noqa: E402
from learner.serve.sampler import SamplerWeights  # noqa: E402
from learner.serve.sampling_routes import scored  # noqa: E402
from learner.serve.service import ServeOptions, make_app  # noqa: E402
from learner.serve.swarm import SwarmSampler  # noqa: E402
from p2p.host import Misbehaviour  # noqa: E402
from p2p.messages import (  # noqa: E402
    GroupSubmission,
    Heartbeat,
    LeaseReply,
    LeaseRequest,
    RolloutSubmission,
    SpecRequest,
)
from p2p.weights import to_float32  # noqa: E402
from tests.conftest import run_cli  # noqa: E402
from tests.test_serve import KEY_A, KEY_B, by_hand_tokenizer, client, datum, sampler_engine, serving  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def join_worker(addr: str, folder, name: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "echo_cli", "worker", "join", "--learner", addr, "--engine", "transformers",
           "--threads", "1", "--max-batch", "4", "--identity", str(folder / f"{name}.key"),
           "--work-dir", str(folder / name)]  # fmt: skip
    log = open(folder / f"{name}.log", "w")  # noqa: SIM115 - as long as the worker
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "120"})


def wait_for(check, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"{what} within {seconds} s"
        time.sleep(0.2)


def test_a_joined_worker_draws_the_samples_a_tinker_client_asks_for(tmp_path, monkeypatch):
    """With a worker joined, a trained client's samples come from the worker (verified by replay): their
    logprobs are the training client's forward on the same tokens; stop tokens and stop strings end them where
    they first appear; greedy and seeded requests are drawn here. The worker killed, requests are drawn here again."""
    for name in ("WAIT_S", "SILENCE_S", "LEASE_BASE_S", "ASKED_S"):  # none drawn here for a slow (loaded) machine
        monkeypatch.setattr(sample_queue, name, 3600.0)
    options = ServeOptions(("tiny",), str(tmp_path / "cache"), "cpu", frozenset({KEY_A}), str(tmp_path / "ckpt"), 3,
                           swarm_listen="/ip4/127.0.0.1/tcp/0", swarm_dir=str(tmp_path / "swarm"))  # fmt: skip
    app = make_app(options, sampler_engine)
    swarm: SwarmSampler = app.state.service.swarm
    worker = join_worker((tmp_path / "swarm" / "learner.addr").read_text().strip(), tmp_path, "w1")
    try:
        with serving(options, app) as url:
            wait_for(lambda: any(w.version >= 0 for w in swarm.board.workers.values()), 300, "the worker holds v0")
            tc = client(url).create_lora_training_client(base_model="tiny", rank=4).result()
            tokens = [5, 17, 99, 3, 42, 7, 61]
            for _ in range(2):
                tc.forward_backward([datum(tokens)], "cross_entropy")
                tc.optim_step(types.AdamParams(learning_rate=0.05))
            sampler = tc.save_weights_and_get_sampling_client().result()
            prompt = types.ModelInput.from_ints(tokens[:3])
            params = types.SamplingParams(max_tokens=6, temperature=1.0)
            futures = [sampler.sample(prompt, num_samples=5, sampling_params=params) for _ in range(3)]
            outs = [f.result() for f in futures]
            assert swarm.summary()["answered"] == 3 and swarm.summary()["sampled_here"] == 0
            eos = swarm.stop_default  # (the model's end of turn ends a sample too)
            for seq in [s for out in outs for s in out.sequences]:
                ended = seq.tokens[-1] in eos
                assert seq.stop_reason == ("stop" if ended else "length") and (ended or len(seq.tokens) == 6)
                forward = tc.forward([datum(tokens[:3] + seq.tokens)], "cross_entropy").result()
                logprobs = forward.loss_fn_outputs[0]["logprobs"].to_numpy()[2:]
                assert np.allclose(seq.logprobs, logprobs, atol=5e-3)  # f16 weights: 2.3e-3 seen once

            first = outs[0].sequences[0].tokens
            stop = types.SamplingParams(max_tokens=6, temperature=1.0, stop=[first[1]])
            for seq in sampler.sample(prompt, num_samples=8, sampling_params=stop).result().sequences:
                assert first[1] not in seq.tokens[:-1]
                assert seq.stop_reason == ("stop" if seq.tokens[-1] in eos | {first[1]} else "length")
            tokenizer = by_hand_tokenizer()
            # two sampled tokens as a stop string; not bytes that decode to U+FFFD (a part of a UTF-8 character)
            texts = [tokenizer.decode(first[i : i + 2]) for i in range(2, len(first) - 1)]
            text = next((t for t in texts if "\ufffd" not in t and t.strip()), "a")
            cut = types.SamplingParams(max_tokens=6, temperature=1.0, stop=[text])
            for seq in sampler.sample(prompt, num_samples=8, sampling_params=cut).result().sequences:
                assert text not in tokenizer.decode(seq.tokens[:-1])
                ended = text in tokenizer.decode(seq.tokens) or seq.tokens[-1] in eos  # (end of turn stops too)
                assert seq.stop_reason == ("stop" if ended else "length")
            greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
            sampler.sample(prompt, num_samples=1, sampling_params=greedy).result()
            assert swarm.summary()["answered"] == 5 and swarm.summary()["sampled_here"] == 0  # greedy: here
            long = types.SamplingParams(max_tokens=280, temperature=1.0)  # (about 7000 tokens: a 110 KB answer)
            out = sampler.sample(prompt, num_samples=40, sampling_params=long).result()
            assert len(out.sequences) == 40 and swarm.summary()["answered"] == 6
            seeded = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
            sampler.sample(prompt, num_samples=5, sampling_params=seeded).result()
            assert swarm.summary()["answered"] == 6  # seeded: here, to repeat bit for bit

            worker.send_signal(signal.SIGKILL)
            worker.wait(30)
            swarm.board.workers.clear()  # (as the sweep does once it has been SILENCE_S without a word from it)
            out = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
            assert len(out.sequences) == 2 and swarm.summary()["answered"] == 6
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(30)


def test_one_worker_draws_two_tenants_samplers_switching_adapters_per_lease(tmp_path, monkeypatch):
    """Two keys' training clients on one base model (one adapting the output layer, one not), their samplers'
    requests sent at once: the one worker holds both samplers' adapters and switches per lease, so it draws every
    request (none here), and each sample's logprobs are its own tenant's forward; a tenant's next sampler is
    drawn by it too while the other's is still held. With a sample seed, a sample the worker drew is the one
    drawn here alone for the same draw id, tokens and logprobs to the bit."""
    for name in ("WAIT_S", "SILENCE_S", "LEASE_BASE_S", "ASKED_S"):  # none drawn here for a slow (loaded) machine
        monkeypatch.setattr(sample_queue, name, 3600.0)
    options = ServeOptions(("tiny",), str(tmp_path / "cache"), "cpu", frozenset({KEY_A, KEY_B}),
                           str(tmp_path / "ckpt"), 3, swarm_listen="/ip4/127.0.0.1/tcp/0",
                           swarm_dir=str(tmp_path / "swarm"), sample_seed=5)  # fmt: skip
    app = make_app(options, sampler_engine)
    svc = app.state.service
    swarm: SwarmSampler = svc.swarm
    submitted = []  # (weights, request, draw id) of every request that went to the swarm
    submit = swarm.submit
    monkeypatch.setattr(swarm, "submit", lambda *args: submitted.append(args[:3]) or submit(*args))
    worker = join_worker((tmp_path / "swarm" / "learner.addr").read_text().strip(), tmp_path, "w1")
    tokens = [5, 17, 99, 3, 42, 7, 61]
    params = types.SamplingParams(max_tokens=6, temperature=1.0)
    prompt = types.ModelInput.from_ints(tokens[:3])
    try:
        with serving(options, app) as url:
            wait_for(lambda: any(w.version >= 0 for w in swarm.board.workers.values()), 300, "the worker holds v0")
            sc_a, sc_b = client(url, KEY_A), client(url, KEY_B)
            a = sc_a.create_lora_training_client(base_model="tiny", rank=4).result()
            b = sc_b.create_lora_training_client(base_model="tiny", rank=2, train_unembed=False).result()

            def step(tc, data: list[int]):
                tc.forward_backward([datum(data)], "cross_entropy")
                tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
                return tc.save_weights_and_get_sampling_client().result()

            def check(tc, outs) -> None:
                for seq in [s for out in outs for s in out.sequences]:
                    forward = tc.forward([datum(tokens[:3] + seq.tokens)], "cross_entropy").result()
                    logprobs = forward.loss_fn_outputs[0]["logprobs"].to_numpy()[2:]
                    assert np.allclose(seq.logprobs, logprobs, atol=5e-3)  # f16 weights: 2.3e-3 seen once

            sampler_a, sampler_b = step(a, tokens), step(b, tokens[::-1])
            futures = [s.sample(prompt, num_samples=3, sampling_params=params) for s in [sampler_a, sampler_b] * 2]
            outs = [f.result() for f in futures]
            assert swarm.summary()["answered"] == 4 and swarm.summary()["sampled_here"] == 0
            check(a, outs[0::2])
            check(b, outs[1::2])
            def bits(seqs) -> list:  # (the wire carries float32 logprobs)
                return [(s.tokens, np.float32(s.logprobs).tolist()) for s in seqs]

            # (the model thread is idle now; requests may reach serve in another order than sent, and identical
            # ones in flight may trade their samples: compared as sorted lists)
            here = [scored(svc, w, req, svc.sampler.sample(w, req, draw)).samples for w, req, draw in submitted]
            assert sorted(bits(out.sequences) for out in outs) == sorted(bits(samples) for samples in here)

            sampler_a = step(a, tokens)  # a's next sampler, b's still the one the worker holds
            futures = [s.sample(prompt, num_samples=3, sampling_params=params) for s in [sampler_a, sampler_b]]
            outs = [f.result() for f in futures]
            assert swarm.summary()["answered"] == 6 and swarm.summary()["sampled_here"] == 0
            check(a, outs[:1])
            check(b, outs[1:])
            assert not swarm.verifier.flagged
            addr = (tmp_path / "swarm" / "learner.addr").read_text().strip()
            res = run_cli("status", "--learner", addr, "--json")  # serve's swarm side, over the wire
            assert res.returncode == 0, res.stderr
            doc = json.loads(res.stdout)
            assert doc["kind"] == "serve" and doc["answered"] == 6 and doc["draws_alone"]
            [row] = doc["peers"]
            assert row["answered"] == 6 and row["tokens_per_s"] > 0 and row["hardware"]["engine"] == "transformers"
            assert doc["verification"]["groups_checked"] >= 6 and not doc["verification"]["flagged"]
            res = run_cli("status", "--learner", addr, columns=100)
            assert res.returncode == 0 and "sampling tiny" in res.stdout and row["peer_id"][-8:] in res.stdout
            sc_a.close("success").result()  # (else the SDK's heartbeats outlive the server, and say so)
            sc_b.close("success").result()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(30)


def test_the_board_leases_the_versions_a_worker_holds_and_never_a_lost_lease_it_dropped(monkeypatch):
    """SampleBoard with two versions' requests: a worker running one is leased its own (no switch) unless the
    other's waited SWITCH_S longer; a worker holding the other's adapters is leased that; a lease whose reply was
    lost is given again only while the worker still holds its version, else its requests queue again (nobody
    banned); a held version never published is a lie."""
    from learner.serve.sample_queue import SampleBoard, SwarmJob
    from p2p.messages import SamplingParams

    board = SampleBoard()
    params = SamplingParams(1.0, 1.0, 4, 0)
    req = types.SampleRequest(prompt=types.ModelInput.from_ints([5, 17]), num_samples=2,
                              sampling_params=types.SamplingParams(max_tokens=4))  # fmt: skip

    def job(version: int, age: float = 0.0) -> SwarmJob:
        made = SwarmJob(req, [5, 17], secrets.randbits(63), version, params, [], lambda d: None, lambda: None)
        made.queued_at -= age
        return made

    board.publish(1, job(1, age=1.0))
    board.publish(2, job(2))
    for peer in ("a", "b", "c"):
        board.seen(peer, 1, 4)
    assert board.working() == {1, 2}
    assert board.lease("a", 2, 8).version == 2  # its own version's, though v1's is a second older
    assert board.lease("b", 1, 8, held=(2,)).version == 1
    assert board.lease("c", 0, 8) is None  # holds neither
    board.add(job(1, age=10.0))
    board.add(job(2))
    assert board.lease("c", 2, 8, held=(1,)).version == 1  # v1's waited far longer: the switch is worth it
    lost = board.lease("a", 2, 8)  # a asks again: the same lease (its reply was lost)
    assert lost is not None and lost.version == 2
    assert board.lease("a", 3, 8) is None  # it no longer holds v2 (nor v3's requests exist): requeued
    assert [j.version for j in board.queue] == [2, 2] and "a" not in board.banned
    for worker in board.workers.values():
        worker.asked = 0.0  # (none asked lately)
    assert board.live({})  # b's and c's leases are out
    board.take("b", board.lease("b", 1, 8, held=(2,)).lease_id)
    board.leases.clear()
    assert board.live({})  # b's answer is being verified: it asks again once that is done
    with pytest.raises(Misbehaviour):
        board.lease("a", 1, 8, held=(9,))


def test_a_lease_is_timed_and_sized_for_the_rate_its_worker_answers_at(monkeypatch):
    """SampleBoard.lease: 20 tokens/s for a worker not yet measured (whatever it declares) and for a fast one
    (never shorter than that), then half the rate its verified answers came at, measured here: a slow worker's
    lease gets more time (at most STRETCH times as much) and holds fewer requests, its first always whole."""
    from learner.serve import sample_queue as sq
    from p2p.messages import SamplingParams

    clock = [1000.0]
    monkeypatch.setattr(sq.time, "monotonic", lambda: clock[0])

    def job(max_tokens: int) -> sq.SwarmJob:
        req = types.SampleRequest(prompt=types.ModelInput.from_ints([5, 17]), num_samples=4,
                                  sampling_params=types.SamplingParams(max_tokens=max_tokens))  # fmt: skip
        params = SamplingParams(1.0, 1.0, max_tokens, 0)
        return sq.SwarmJob(req, [5, 17], secrets.randbits(63), 1, params, [], lambda d: None, lambda: None)

    def answer(peer: str, after: float, tokens: int) -> None:
        lease = next(x for x in board.leases.values() if x.worker == peer)
        clock[0] += after
        board.done(board.take(peer, lease.lease_id), verified=True, tokens=tokens)

    board = sq.SampleBoard()
    board.publish(1, job(100))  # 4 x 100 = 400 tokens
    board.seen("slow", 1, 4, tokens_per_s=0.001)  # (declared: not used)
    assert board.lease("slow", 1, 8).deadline - clock[0] == sq.LEASE_BASE_S + 400 / 20
    answer("slow", 25.0, 200)  # 200 tokens in 25 s: 8 tokens/s measured, its leases timed at 4
    board.seen("fast", 1, 4)
    for _ in range(3):
        board.add(job(100))
    assert len(board.lease("fast", 1, 8).jobs) == 1  # (not yet proven: one request)
    answer("fast", 2.0, 400)  # 200 tokens/s: timed at 20, as any
    lease = board.lease("fast", 1, 8)
    assert len(lease.jobs) == 2 and lease.deadline - clock[0] == sq.LEASE_BASE_S + 800 / 20
    board.add(job(100))
    assert board.lease("slow", 1, 8).deadline - clock[0] == sq.LEASE_BASE_S + 400 / 4
    answer("slow", 500.0, 100)  # slower still: 300 tokens in 525 s in all, timed at 0.29 tokens/s
    board.add(job(100))
    board.add(job(100))
    lease = board.lease("slow", 1, 8)
    assert len(lease.jobs) == 1  # its share of LEASE_TOKENS (163 tokens) holds no second request; the first whole
    assert lease.deadline - clock[0] == sq.STRETCH * (sq.LEASE_BASE_S + 400 / 20)  # 200 s, not 30 + 400 / 0.29
    [row] = [p for p in board.peers({}) if p["peer_id"] == "slow"]
    assert row["answered"] == 2 and row["tokens_per_s"] == round(300 / 525, 2) and row["declared_tokens_per_s"]


def test_a_worker_keeps_the_adapters_wanted_and_drops_the_others_first():
    from worker.fetcher import VersionFetcher

    class Peer:
        on_announce = None

    fetcher = VersionFetcher(Peer(), None, None, lambda: 0, lambda: 0, slots=2)
    fetcher._keep(5, {"a": np.zeros(1)})
    fetcher._keep(6, {"a": np.zeros(1)})
    fetcher._keep(7, {"a": np.zeros(1)}, wanted=frozenset({5, 7}))
    assert list(fetcher.held_adapters()) == [5, 7]  # 6 went: nothing waits on it


@pytest.fixture(scope="module")
def side(tmp_path_factory):
    folder = tmp_path_factory.mktemp("swarm")
    swarm = SwarmSampler("tiny", str(folder / "cache"), "/ip4/127.0.0.1/tcp/0", str(folder / "side"))
    yield swarm
    swarm.close()


class Request:
    """One asample request queued on the swarm side, and what became of it."""

    def __init__(self, swarm: SwarmSampler, weights: SamplerWeights, prompt: list[int], n: int, **params) -> None:
        self.drawn, self.draw = None, secrets.randbits(63)
        self.here = 0
        req = types.SampleRequest(prompt=types.ModelInput.from_ints(prompt), num_samples=n,
                                  sampling_params=types.SamplingParams(**params), sampling_session_id="s")  # fmt: skip
        self.queued = swarm.submit(weights, req, self.draw, self._answer, self._here)

    def _answer(self, drawn) -> None:
        self.drawn = drawn

    def _here(self) -> None:
        self.here += 1


def honest(swarm: SwarmSampler, grant) -> list[GroupSubmission]:
    """What an honest transformers worker submits for `grant`: drawn with the version's weights."""
    from worker.engines import make_engine

    engine = make_engine("transformers", "", threads=1, max_batch=8, device="cpu")
    base, _ = swarm.verifier.versions[0]
    adapters, _ = swarm.verifier.versions[grant.min_version]
    engine.load_policy(swarm.spec, {n: to_float32(a) for n, a in base.items() if n != "lm_head.weight"})
    engine.load_adapters(swarm.spec, {n: to_float32(a) for n, a in adapters.items()})
    groups = engine.generate(grant.requests, grant.params)
    return [GroupSubmission(r.group, cs) for r, cs in zip(grant.requests, groups, strict=True)]


def test_the_swarm_side_verifies_every_sample_and_a_forger_is_flagged_and_costs_nobody(side, monkeypatch):
    """Handlers called as workers would: an honest worker's samples answer the requests (one group per request,
    split to its batch) with the replay's logprobs; forged logprobs, a sample cut short, another worker's
    lease and a lapsed lease are refused, the worker flagged or banned, and its requests drawn here; a worker
    holds one lease at a time; a request no worker leases in time is drawn here."""
    monkeypatch.setattr(sample_queue, "ASKED_S", 3600.0)  # (a loaded machine may take seconds between two calls)
    swarm = side
    rng = np.random.default_rng(0)
    adapters = {name: rng.normal(0, 0.05, a.shape).astype(np.float32) for name, a in tiny_adapters(swarm).items()}
    weights = SamplerWeights("tiny", 4, adapters)
    assert not Request(swarm, weights, [5, 17], 3, max_tokens=5).queued  # no worker heard from: drawn here

    def join(peer: str, version: int) -> None:
        swarm._on_spec(peer, SpecRequest().to_wire())
        swarm._on_heartbeat(peer, Heartbeat(version, 0.0, 0.0, {"max_batch": 4}).to_wire())

    def lease(peer: str, version: int):
        return LeaseReply.from_wire(swarm._on_lease(peer, LeaseRequest(version, 8).to_wire())).grant

    def rollout(peer: str, grant, groups) -> dict:
        return swarm._on_rollout(peer, RolloutSubmission(grant.id, grant.min_version, groups).to_wire())

    join("honest", 0)
    assert lease("honest", 0) is None  # it asks for work: a live worker
    requests = [Request(swarm, weights, [5, 17, 3], 6, max_tokens=5, temperature=0.9, top_p=0.95) for _ in range(3)]
    assert all(r.queued for r in requests)
    version = swarm.board.version
    assert lease("honest", 0) is None  # it holds v0: it fetches the sampler's version first
    grant = lease("honest", version)
    assert len(grant.requests) == 2  # a new worker's lease: one request, its 6 samples in 2 groups of 3
    assert lease("honest", version).id == grant.id  # asked again: its reply was lost, the same lease again
    with pytest.raises(Misbehaviour):
        lease("honest", version + 2)  # a version never published (one more may be on its way)
    groups = honest(swarm, grant)
    with pytest.raises(Misbehaviour):
        rollout("someone", grant, groups)  # not its lease

    join("forger", version)
    forger_grant = lease("forger", version)
    cut = honest(swarm, forger_grant)
    whole = next(c for g in cut for c in g.completions if c.finish_reason == "length")
    whole.tokens.pop(), whole.logprobs.pop()  # stopped early, without a stop token: the rest was never drawn
    with pytest.raises(Misbehaviour):
        rollout("forger", forger_grant, cut)
    assert "does not end" in swarm.verifier.flagged["forger"]
    with pytest.raises(Misbehaviour):
        lease("forger", version)  # flagged: no more leases
    assert [r.here for r in requests] == [0, 1, 0]  # its request: drawn here

    assert rollout("honest", grant, groups)["accepted"] == 2
    drawn = requests[0].drawn.samples
    assert len(drawn) == 6 and requests[1].drawn is None and requests[2].drawn is None
    sent = [c for g in groups for c in g.completions]
    assert [c.tokens for c in drawn] == [c.tokens for c in sent]
    assert np.allclose([x for c in drawn for x in c.logprobs], [x for c in sent for x in c.logprobs], atol=1e-3)
    with pytest.raises(Misbehaviour):  # sent again: no lease of it is out
        rollout("honest", grant, groups)

    grant = lease("honest", version)
    assert len(grant.requests) == 2  # the request left
    forged = honest(swarm, grant)
    for c in forged[0].completions:
        c.logprobs[:] = [x - 0.3 for x in c.logprobs]
    with pytest.raises(Misbehaviour):
        rollout("honest", grant, forged)
    assert "logprobs diverge" in swarm.verifier.flagged["honest"]
    assert [r.here for r in requests] == [0, 1, 1] and swarm.summary()["queued"] == 0

    join("silent", version)
    join("idle", version)
    assert lease("silent", version) is None and lease("idle", version) is None
    late = [Request(swarm, weights, [9, 4], 2, max_tokens=4) for _ in range(2)]  # (a newer version: idle
    assert all(r.queued for r in late)  # workers hold the last one; they are live while they ask)
    assert len(lease("silent", swarm.board.version).requests) == 1
    swarm.board.workers["silent"].seen -= sample_queue.SILENCE_S + 1  # it went silent holding its lease
    swarm.board.queue[0].queued_at -= sample_queue.WAIT_S + 1  # and nobody leased the other in time
    swarm.board.sweep()  # the lease lapses: its request is drawn here, as is the one left waiting
    assert [r.here for r in late] == [1, 1] and swarm.summary()["leases"] == 0
    assert "silent" not in swarm.board.workers and lease("silent", swarm.board.version) is None  # banned still


def tiny_adapters(swarm: SwarmSampler) -> dict[str, np.ndarray]:
    """Rank-4 adapter shapes on every projection of the tiny model (names as learner.train.lora makes them)."""
    base, _ = swarm.verifier.versions[0]
    out = {}
    for name, a in base.items():
        if a.ndim == 2 and name.endswith("_proj.weight"):
            stem = name.removesuffix(".weight")
            out[f"{stem}.lora_A.weight"] = np.zeros((4, a.shape[1]), np.float32)
            out[f"{stem}.lora_B.weight"] = np.zeros((a.shape[0], 4), np.float32)
    return out


def test_nothing_a_worker_sends_the_swarm_side_raises_anything_but_a_refusal(side, monkeypatch):
    """Hostile frames at serve's swarm handlers (wrong types, NaN and infinite logprobs, token ids outside the
    vocabulary or 64 bits wide, lengths that disagree, another lease's id, a version never published): each is
    refused as a BadRequest or MessageError (a reply to the peer, a penalty), never another exception (a stack
    trace in serve's log, and no cost to the sender); a lease answered with garbage is drawn here and its worker
    banned; an honest worker still gets the next request."""
    from p2p.host import BadRequest
    from p2p.messages import MessageError

    monkeypatch.setattr(sample_queue, "ASKED_S", 3600.0)
    swarm = side
    weights = SamplerWeights("tiny", 4, tiny_adapters(swarm))
    refusals = (BadRequest, MessageError)

    def refused(handler, peer: str, msg: object) -> None:
        with pytest.raises(refusals):
            handler(peer, msg)

    garbage: list[object] = [{}, {"version": "7"}, {"version": -2}, {"version": 2**70}, {"version": float("nan")},
                             {"version": 0, "max_groups": 2**80}, {"version": [0]}, {"hardware": [1]},
                             {"version": 0, "held": [1, 1]}, {"version": 0, "held": list(range(17))},
                             {"version": 0, "held": [-1]}, {"version": 0, "held": [2**40]}, {"version": 0, "held": "1"},
                             {"version": 0, "held": [99]}, {"version": 0, "held": [True]}]  # fmt: skip
    for msg in garbage:
        for handler in (swarm._on_lease, swarm._on_rollout):
            refused(handler, "stranger", msg)
    swarm._on_heartbeat("stranger", {"version": 0, "hardware": {"max_batch": 10**30}})  # (an absurd batch: ignored)
    assert swarm.board.workers["stranger"].max_batch <= 256

    def leased(peer: str):
        swarm._on_heartbeat(peer, Heartbeat(0, 0.0, 0.0, {"max_batch": 4}).to_wire())
        assert LeaseReply.from_wire(swarm._on_lease(peer, LeaseRequest(0, 8).to_wire())).grant is None
        request = Request(swarm, weights, [5, 17, 3], 2, max_tokens=4, temperature=1.0)
        assert request.queued
        version = swarm.board.version
        swarm._on_heartbeat(peer, Heartbeat(version, 0.0, 0.0, {"max_batch": 4}).to_wire())
        grant = LeaseReply.from_wire(swarm._on_lease(peer, LeaseRequest(version, 8).to_wire())).grant
        return request, grant, RolloutSubmission(grant.id, version, honest(swarm, grant)).to_wire()

    def spoil(**change):
        def apply(msg: dict) -> dict:
            c = msg["groups"][0]["completions"][0]
            for key, value in change.items():
                c[key] = value(c[key]) if callable(value) else value
            return msg

        return apply

    spoils = [
        spoil(logprobs=lambda xs: [float("nan")] * len(xs)),
        spoil(logprobs=lambda xs: [float("inf")] * len(xs)),
        spoil(logprobs=lambda xs: [-1e308] * len(xs)),
        spoil(logprobs=lambda xs: xs[:-1]),
        spoil(tokens=lambda ts: [10**6] * len(ts)),
        spoil(tokens=lambda ts: [2**64 + 1] * len(ts)),
        spoil(tokens=lambda ts: [-1] * len(ts)),
        spoil(tokens=lambda ts: [float(t) for t in ts]),
        spoil(tokens=lambda ts: []),
        spoil(finish="done"),
        lambda msg: msg | {"version": msg["version"] + 1},
        lambda msg: msg | {"groups": msg["groups"] * 2},  # a group the lease does not hold
        lambda msg: msg | {"groups": [{"group": "0", "completions": g["completions"]} for g in msg["groups"]]},
        lambda msg: msg | {"groups": [g | {"group": g["group"] ^ 1} for g in msg["groups"]]},  # another draw id
        lambda msg: msg | {"lease": msg["lease"] ^ 1},
    ]
    for k, ruin in enumerate(spoils):
        peer = f"hostile-{k}"
        request, grant, msg = leased(peer)
        refused(swarm._on_rollout, peer, ruin(msg))
        assert request.here == 1 or swarm.board.leases  # drawn here, or (a wrong lease id) still out with it
        swarm.board.leases.clear()  # (its lapse, without waiting for it)
        swarm.board.queue.clear()

    request, grant, msg = leased("honest-after")
    assert swarm._on_rollout("honest-after", msg)["accepted"] == len(grant.requests)
    assert len(request.drawn.samples) == 2


@pytest.mark.parametrize("family", __import__("tests.families", fromlist=["FAMILIES"]).FAMILIES)
def test_every_family_draws_a_request_alike_on_a_worker_and_here(family, tmp_path, monkeypatch):
    """Each family's tiny model served with workers, a sampler trained two steps (adapters on the tied output
    layer too): an honest worker's samples pass the replay and answer the request, and the server's own
    sampler (the swarm's 16-bit weights) draws the very same tokens for the same draw id."""
    import torch

    from learner.serve.sampler import LocalSampler
    from learner.serve.trained_model import SharedBase, TrainedModel
    from learner.serve.wire import Datum, ForwardBackward
    from tests.families import save_family

    monkeypatch.setattr(sample_queue, "ASKED_S", 3600.0)
    folder = str(save_family(family, tmp_path / family))
    served = TrainedModel(SharedBase(folder, "unused", "cpu"), lora_rank=4, head=True)
    tokens = np.array([5, 17, 99, 3, 42, 7, 61])
    for _ in range(2):
        served.forward_backward(ForwardBackward("m", 1, "cross_entropy", {}, False, [
            Datum(tokens[:-1], {"target_tokens": tokens[1:]})]))  # fmt: skip
        served.optim_step(0.05, (0.9, 0.95), 1e-8, 0.0, 1.0)
    weights = SamplerWeights(folder, 4, served.adapter_tensors())
    torch.set_num_threads(2)
    swarm = SwarmSampler(folder, str(tmp_path / "cache"), "/ip4/127.0.0.1/tcp/0", str(tmp_path / "side"))
    try:
        swarm._on_heartbeat("w", Heartbeat(0, 0.0, 0.0, {"max_batch": 4}).to_wire())
        assert LeaseReply.from_wire(swarm._on_lease("w", LeaseRequest(0, 8).to_wire())).grant is None
        request = Request(swarm, weights, [5, 17, 3], 6, max_tokens=6, temperature=1.0)
        assert request.queued
        version = swarm.board.version
        grant = LeaseReply.from_wire(swarm._on_lease("w", LeaseRequest(version, 8).to_wire())).grant
        assert [r.completion for r in grant.requests] == [0, 3]  # 6 samples, a batch of 4: 2 groups of 3
        swarm._on_rollout("w", RolloutSubmission(grant.id, version, honest(swarm, grant)).to_wire())
        by_worker = [s.tokens for s in request.drawn.samples]
    finally:
        swarm.close()
    local = LocalSampler(sampler_engine, str(tmp_path / "cache"), frozenset({folder}))
    req = types.SampleRequest(prompt=types.ModelInput.from_ints([5, 17, 3]), num_samples=6,
                              sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0))  # fmt: skip
    here = [s.tokens for s in local.sample(weights, req, request.draw).samples]  # (in waves of 4: 4 + 2)
    assert here == by_worker, family
