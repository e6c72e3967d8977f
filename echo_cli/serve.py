"""`echo-rl serve`: the Tinker API on this machine (learner/serve), until Ctrl-C."""

from __future__ import annotations

import logging
from typing import Any

from learner.serve.config import ServeConfig, api_keys
from p2p.auth import read_secret

log = logging.getLogger(__name__)


def run_server(cfg: ServeConfig) -> None:
    """Serve `cfg` with uvicorn in this process; the SDK's base_url is http://HOST:PORT."""
    try:
        import uvicorn

        from learner.serve.service import ServeOptions, make_app
        from worker.engines import make_engine
    except ImportError as exc:
        from p2p.config import ConfigError

        raise ConfigError(f"{exc.name} is not installed: pip install 'echo-rl[serve]'") from None
    keys = api_keys(cfg.api_key_file)
    secret = read_secret(cfg.swarm_secret_file) if cfg.swarm_secret_file else None
    options = ServeOptions(cfg.model_names(), cfg.cache_dir, cfg.device, keys, cfg.checkpoint_dir,
                           max_models_per_key=cfg.max_models_per_key, max_full_models=cfg.max_full_models,
                           swarm_listen=cfg.swarm_listen, swarm_dir=cfg.swarm_dir, swarm_secret=secret,
                           sample_seed=cfg.sample_seed)  # fmt: skip
    log.info("serving the Tinker API on http://%s:%d for %s (%d API keys in %s)", cfg.host, cfg.port,
             ", ".join(options.models), len(keys), cfg.api_key_file)  # fmt: skip
    # at most 256 connections at once (more get 503); idle keep-alive connections close after 5 s

    def sampler_engine() -> Any:  # the reference engine: it runs adapters on any layer, the output layer's too
        return make_engine("transformers", cfg.cache_dir, cfg.sampler_threads, cfg.sampler_max_batch, device=cfg.device)

    uvicorn.run(make_app(options, sampler_engine), host=cfg.host, port=cfg.port, log_level="warning",
                limit_concurrency=256, timeout_keep_alive=5)  # fmt: skip
