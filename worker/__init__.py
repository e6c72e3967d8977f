"""The rollout worker: the daemon (`echo-rl worker join`), its inference engines (llama.cpp, transformers),
the GGUF conversion of wire weights and the seeded sampler."""
