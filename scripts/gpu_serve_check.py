"""GPU check of #33's serve paths on CUDA (scripts/gpu_check_tiny.sh runs it): a LoRA training client
(TrainedModel) trained on cuda, its sampler drawn by the transformers engine on cuda, every sample scored alone
(SampleScorer) on cuda, and the same on the CPU for comparison."""
import sys
import time

import numpy as np
import torch
from tinker import types

sys.path.insert(0, ".")
from learner.serve.sampler import LocalSampler, SamplerWeights  # noqa: E402
from learner.serve.scorer import SampleScorer  # noqa: E402
from learner.serve.trained_model import SharedBase, TrainedModel  # noqa: E402
from learner.serve.wire import Datum, ForwardBackward  # noqa: E402
from worker.engines import make_engine  # noqa: E402

tokens = np.array([5, 17, 99, 3, 42, 7, 61, 8, 8, 30])
out = {}
for device in ("cuda", "cpu"):
    torch.manual_seed(0)
    model = TrainedModel(SharedBase("tiny", "/tmp/cache", device), lora_rank=4, head=True)
    losses = []
    for _ in range(5):
        fb = ForwardBackward("m", 1, "cross_entropy", {}, False, [Datum(tokens[:-1], {"target_tokens": tokens[1:]})])
        _, metrics = model.forward_backward(fb)
        losses.append(round(float(next(iter(metrics.values()))), 5))
        model.optim_step(0.05, (0.9, 0.95), 1e-8, 0.0, 1.0)
    weights = SamplerWeights("tiny", 4, model.adapter_tensors())
    sampler = LocalSampler(lambda d=device: make_engine("transformers", "/tmp/cache", 4, 8, device=d), "/tmp/cache")
    req = types.SampleRequest(prompt=types.ModelInput.from_ints([5, 17, 3]), num_samples=8,
                              sampling_params=types.SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9))
    tick = time.perf_counter()
    drawn = sampler.sample(weights, req, draw=123)
    scored = SampleScorer("/tmp/cache", frozenset(), device).score(weights, [5, 17, 3], drawn, 1.0, 0.9)
    out[device] = (losses, [s.tokens for s in scored.samples], [x for s in scored.samples for x in s.logprobs])
    print(device, "losses", losses, "sample+score s", round(time.perf_counter() - tick, 2), flush=True)
(lc, tc, pc), (lp, tp, pp) = out["cuda"], out["cpu"]
print("tokens equal cuda/cpu:", tc == tp, "| scored logprobs max |diff|:",
      float(np.abs(np.array(pc) - np.array(pp)).max()) if tc == tp else "n/a",
      "| loss max |diff|:", max(abs(a - b) for a, b in zip(lc, lp, strict=True)))
assert lc[-1] < lc[0], "loss did not fall on cuda"
print("serve_cuda: ok")
