"""Build small local model directories (tokenizer.json + chat template).

No model hub is reachable from where the gateway is tested, and the demo must run with
nothing downloaded. So we train a small byte-level BPE tokenizer on a fixed corpus and save
it the way Hugging Face model repos are laid out; the gateway and the simulated engines
then load it with the same code that loads a real model directory.
Training is deterministic: the same corpus gives the same tokenizer everywhere.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"

# ChatML, with a BOS from the template as Llama-3-style templates do (so chat prompts must be
# encoded with add_special_tokens=False, or BOS would be counted twice).
CHATML_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Words the simulated engines generate from; also the tokenizer's training corpus.
WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "more can out up about into them some could time only other new model token gpu batch cache "
    "prompt stream request replica latency throughput engine gateway serve inference memory "
    "attention layer weight tensor kernel queue prefill decode sequence context window length "
    "system user assistant answer question hello world please write short story about a cat dog "
    "river mountain city light dark quick brown fox jumps over lazy day night morning evening "
    "data compute fast slow first second third number value result test case load balance"
).split()

_CORPUS_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Please write a short story about a cat.",
    "What is the capital of France? Paris is the capital of France.",
    "The gateway routes each request to the replica with the least outstanding tokens.",
    "Time to first token and inter-token latency are what users feel.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14 -42",
)


def _corpus() -> list[str]:
    words = " ".join(WORDS)
    return [words, words.capitalize(), *_CORPUS_SENTENCES] * 20


def train_tokenizer(vocab_size: int = 1024) -> Tokenizer:
    """Train a byte-level BPE (any UTF-8 text encodes; a token covers >= 1 byte) with a BOS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)],
    )
    return tokenizer


def write_model_dir(path: str | Path, vocab_size: int = 1024,
                    chat_template: str = CHATML_TEMPLATE, max_model_len: int = 8192) -> Path:
    """Write tokenizer.json + tokenizer_config.json (with the chat template) into ``path``."""
    model_dir = Path(path)
    model_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer(vocab_size).save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": max_model_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return model_dir


def builtin_model_dir() -> Path:
    """The built-in model directory, written once per machine into the user cache."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llm-gateway"
    target = cache / "builtin-model-v1"
    if (target / "tokenizer_config.json").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    # Write aside and rename, so concurrent processes never see a half-written directory.
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=".builtin-"))
    write_model_dir(staging)
    try:
        staging.rename(target)
    except OSError:  # another process won the race; its directory is identical
        pass
    return target
