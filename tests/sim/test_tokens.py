"""usage.prompt_tokens equals an independent count by transformers on the same model directory."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from gateway.sim.model_dir import write_model_dir
from tests.sim.conftest import FAST
from tests.support import sim

CONVERSATIONS = [
    [{"role": "user", "content": "Hello world!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  What is the capital of France?  "},
     {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy? ünïcødé ✓ 3.14"}],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return write_model_dir(tmp_path_factory.mktemp("model"))


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "llamacpp", "tgi"])
def test_prompt_tokens_match_transformers(model_dir, dialect: str) -> None:
    hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    with sim(dialect, "m", 4096, *FAST, "--tokenizer", str(model_dir)) as base:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        for messages in CONVERSATIONS:
            rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            expected = len(hf(rendered, add_special_tokens=False).input_ids)
            out = c.chat.completions.create(model="m", messages=messages, max_tokens=1)
            assert out.usage.prompt_tokens == expected
        text = "The gateway routes each request. ✓"
        out = c.completions.create(model="m", prompt=text, max_tokens=1)
        assert out.usage.prompt_tokens == len(hf(text).input_ids)  # completions add BOS
