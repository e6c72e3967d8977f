"""learner/serve/draw_ids.py: which draws an asample request gets."""

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from learner.serve.draw_ids import DrawIds  # noqa: E402


def request(prompt: list[int], n: int = 4, **params) -> tuple[types.SampleRequest, list[int]]:
    req = types.SampleRequest(prompt=types.ModelInput.from_ints(prompt), num_samples=n,
                              sampling_params=types.SamplingParams(max_tokens=8, **params))  # fmt: skip
    return req, prompt


def test_a_sample_seed_makes_the_kth_request_of_a_sampler_draw_alike_on_every_server():
    first, again = DrawIds(5), DrawIds(5)
    ids = [first.draw_id("key", "train:0:sample:1", *request([1, 2, 3])) for _ in range(3)]
    assert ids == [again.draw_id("key", "train:0:sample:1", *request([1, 2, 3])) for _ in range(3)]
    assert len(set(ids)) == 3 and all(0 <= i < 1 << 63 for i in ids)  # each request its own draws
    assert first.draw_id("other", "train:0:sample:1", *request([1, 2, 3])) == ids[0]  # another key: its own counts
    fresh = DrawIds(5)
    others = {
        fresh.draw_id("key", "train:0:sample:2", *request([1, 2, 3])),  # another sampler
        fresh.draw_id("key", "train:0:sample:1", *request([1, 2, 4])),  # another prompt
        fresh.draw_id("key", "train:0:sample:1", *request([1, 2, 3], n=5)),  # other params
        DrawIds(6).draw_id("key", "train:0:sample:1", *request([1, 2, 3])),  # another sample seed
    }
    assert len(others) == 4 and not others & set(ids)


def test_a_seeded_request_draws_by_its_seed_alone_and_unseeded_ones_afresh_without_a_sample_seed():
    seeded = {
        DrawIds(s).draw_id(k, n, *request(p, seed=3)) for s in (-1, 5) for k in "ab" for p in [[7], [8]] for n in "xy"
    }
    assert len(seeded) == 1 and seeded != {DrawIds().draw_id("a", "x", *request([7, 8], seed=4))}
    afresh = DrawIds()
    assert len({afresh.draw_id("a", "x", *request([7, 8])) for _ in range(4)}) == 4


def test_counts_are_kept_for_each_keys_newest_triples_only():
    ids = DrawIds(5, most=2)
    first = ids.draw_id("k", "s", *request([1]))
    for prompt in ([2], [3], [4], [5]):
        ids.draw_id("other", "s", *request(prompt))  # another key's requests leave ours alone
    assert ids.draw_id("k", "s", *request([1])) != first
    ids.draw_id("k", "s", *request([2]))
    ids.draw_id("k", "s", *request([3]))  # [1]'s count is forgotten: asked again, it counts from 0
    assert ids.draw_id("k", "s", *request([1])) == first
