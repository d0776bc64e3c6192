"""A tiny random-weight Llama, written on the spot as a Hugging Face model directory.

No model hub is reachable here, so the real engines (vLLM, llama.cpp) serve weights the tests
make: the gateway's own trained byte-level BPE tokenizer and chat template
(``gateway.model_dir``), a ``LlamaConfig`` small enough to load in a second on a CPU, and
random weights from a fixed seed (numpy, so the test environment needs no torch). The engines
load it with the same code that loads a real checkpoint.

``head_dim`` is 32 because vLLM's CPU attention takes only some sizes (32, 64, 80, ...).
An adapter (``write_lora``) is PEFT's layout, as ``--lora-modules`` loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from gateway.model_dir import BOS, EOS, write_model_dir

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 32
MAX_POSITIONS = 1024


def _normal(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) * 0.02).astype(np.float32)


def write_tiny_llama(path: str | Path, seed: int = 0) -> Path:
    """The tokenizer and chat template, ``config.json`` and ``model.safetensors``."""
    model_dir = write_model_dir(path, max_model_len=MAX_POSITIONS)
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tokenizer["model"]["vocab"]
    specials = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    vocab_size = max([*vocab.values(), *specials.values()]) + 1
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": specials[BOS], "eos_token_id": specials[EOS],
    }
    (model_dir / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    (model_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": specials[BOS], "eos_token_id": specials[EOS]}), encoding="utf-8")
    rng = np.random.default_rng(seed)
    weights = {"model.embed_tokens.weight": _normal(rng, vocab_size, HIDDEN),
               "model.norm.weight": np.ones(HIDDEN, np.float32),
               "lm_head.weight": _normal(rng, vocab_size, HIDDEN)}
    for layer in range(LAYERS):
        at = f"model.layers.{layer}."
        weights |= {
            at + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
            at + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
            at + "self_attn.q_proj.weight": _normal(rng, HEADS * HEAD_DIM, HIDDEN),
            at + "self_attn.k_proj.weight": _normal(rng, KV_HEADS * HEAD_DIM, HIDDEN),
            at + "self_attn.v_proj.weight": _normal(rng, KV_HEADS * HEAD_DIM, HIDDEN),
            at + "self_attn.o_proj.weight": _normal(rng, HIDDEN, HEADS * HEAD_DIM),
            at + "mlp.gate_proj.weight": _normal(rng, INTERMEDIATE, HIDDEN),
            at + "mlp.up_proj.weight": _normal(rng, INTERMEDIATE, HIDDEN),
            at + "mlp.down_proj.weight": _normal(rng, HIDDEN, INTERMEDIATE),
        }
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return model_dir


def write_lora(path: str | Path, base: str, seed: int, rank: int = 8) -> Path:
    """A random rank-``rank`` LoRA adapter on every layer's q_proj and v_proj (PEFT's files).
    Its B matrices are not zero (PEFT's initial value), so the adapter changes the answers."""
    adapter = Path(path)
    adapter.mkdir(parents=True, exist_ok=True)
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": ["q_proj", "v_proj"], "fan_in_fan_out": False,
        "inference_mode": True}, indent=2), encoding="utf-8")
    rng = np.random.default_rng(seed)
    out = {"q_proj": HEADS * HEAD_DIM, "v_proj": KV_HEADS * HEAD_DIM}
    weights = {}
    for layer in range(LAYERS):
        for module, size in out.items():
            at = f"base_model.model.model.layers.{layer}.self_attn.{module}."
            weights[at + "lora_A.weight"] = (rng.standard_normal((rank, HIDDEN)) * 0.5).astype(np.float32)
            weights[at + "lora_B.weight"] = (rng.standard_normal((size, rank)) * 0.5).astype(np.float32)
    save_file(weights, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    return adapter
