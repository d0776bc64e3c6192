"""The cheap upper bound the window check relies on never undercounts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.tokens import ModelTokenizer


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=400), add_special=st.booleans())
def test_byte_bound_is_never_below_the_exact_count(tokenizer: ModelTokenizer, text: str,
                                                   add_special: bool) -> None:
    bound = len(text.encode("utf-8")) + tokenizer.special_token_slack(add_special)
    assert tokenizer.count_text(text, add_special_tokens=add_special) <= bound


def test_chat_counts_match_transformers(tokenizer: ModelTokenizer, model_dir) -> None:
    from transformers import AutoTokenizer
    reference = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                             {"type": "text", "text": "wörld 🌍"}]},
                {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "More?"}]
    plain = [{**m, "content": "\n".join(p["text"] for p in m["content"])}
             if isinstance(m["content"], list) else m for m in messages]
    rendered = reference.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    assert tokenizer.render_chat(messages) == rendered
    assert tokenizer.count_chat(messages) == len(reference(rendered, add_special_tokens=False).input_ids)
    assert tokenizer.count_text("Hello world") == len(reference("Hello world").input_ids)
