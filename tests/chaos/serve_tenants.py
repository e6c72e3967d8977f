"""Two API keys' training clients on one base model of `echo-rl serve`, each trained a step, their samplers'
requests sent at once; prints each request's samples' tokens as JSON (tests/chaos/test_serve_nat.py runs it
beside the server, in the server's namespace):

    python -m tests.chaos.serve_tenants BASE_URL KEY_A KEY_B
"""

import json
import sys

import tinker
from tinker import types

TOKENS = [5, 17, 99, 3, 42, 7, 61]


def datum(tokens: list[int]) -> types.Datum:
    inputs = {"target_tokens": tokens[1:]}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def main(url: str, keys: list[str]) -> None:
    clients = [tinker.ServiceClient(base_url=url, api_key=key) for key in keys]
    samplers = []
    for k, service in enumerate(clients):
        trained = service.create_lora_training_client(base_model="tiny", rank=4).result()
        trained.forward_backward([datum(TOKENS if k == 0 else TOKENS[::-1])], "cross_entropy")
        trained.optim_step(types.AdamParams(learning_rate=0.05)).result()
        samplers.append(trained.save_weights_and_get_sampling_client().result())
    params = types.SamplingParams(max_tokens=6, temperature=1.0)
    prompt = types.ModelInput.from_ints(TOKENS[:3])
    futures = [s.sample(prompt, num_samples=3, sampling_params=params) for s in samplers * 2]
    print(json.dumps([[seq.tokens for seq in f.result().sequences] for f in futures]))
    for service in clients:
        service.close("success").result()  # (else the SDK's heartbeats outlive the server)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
