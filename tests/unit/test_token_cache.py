"""The prefix token cache (gateway/token_cache.py): a prompt's ids from cached segments equal
its whole tokenization, every time, over generated chats, two chat templates, special tokens
inside user text and non-ASCII text at a segment's edge; a tokenizer for which segments are
not independent is caught when the cache is made and tokenized whole; memory stays bounded."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from gateway.sim.model_dir import BOS, EOS, IM_END, IM_START, WORDS, _corpus, write_model_dir
from gateway.token_cache import SegmentTokenCache
from gateway.tokens import ModelTokenizer

# Llama-3's shape of template, on the test tokenizer's special tokens: a header token pair
# around each role, the content after a blank line.
HEADER_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '<|im_end|>\n\n' + m['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_end|>\n\n' }}"
    "{% endif %}")
NASTY = ["é", "\u0301", "🙂", "  ", "\n", "\t", " \n ", "ü", "日本語", BOS, EOS, IM_START,
         IM_END, f"{IM_START}{IM_END}", "<|im_", "_start|>"]


@pytest.fixture(scope="module", params=["chatml", "headers"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> ModelTokenizer:
    kwargs = {} if request.param == "chatml" else {"chat_template": HEADER_TEMPLATE}
    path = write_model_dir(tmp_path_factory.mktemp(request.param), **kwargs)
    tok = ModelTokenizer.from_dir(path)
    tok.enable_cache(1 << 20)
    assert tok.cache is not None and tok.cache.exact
    return tok


def _text(rng: random.Random, words: int) -> str:
    out = []
    for _ in range(words):
        out.append(rng.choice(NASTY) if rng.random() < 0.15 else rng.choice(WORDS))
        out.append(rng.choice(["", " ", " ", "  ", "\n"]))
    return "".join(out)


def _chat(rng: random.Random, system: str) -> list[dict[str, str]]:
    turns = [{"role": "system", "content": system}]
    for i in range(rng.randint(1, 6)):
        turns.append({"role": "user" if i % 2 == 0 else "assistant",
                      "content": _text(rng, rng.randint(0, 40))})
    return turns


def test_a_chats_ids_from_the_cache_are_its_whole_tokenization(tokenizer: ModelTokenizer
                                                                ) -> None:
    rng = random.Random(7)
    systems = [_text(rng, 300) for _ in range(3)]  # repeated: most segments hit
    for _ in range(300):
        text = tokenizer.render_chat(_chat(rng, rng.choice(systems)))
        for add_special in (False, True):
            assert tokenizer.token_ids(text, add_special) == \
                tokenizer.tokenizer.encode(text, add_special_tokens=add_special).ids, text
    cache = tokenizer.cache
    assert cache is not None and cache.hit_tokens > cache.miss_tokens > 0


def test_plain_text_and_edges_equal_whole_tokenization(tokenizer: ModelTokenizer) -> None:
    rng = random.Random(3)
    texts = ["", " ", IM_START, IM_START * 3, f"{IM_END} x", f"x {IM_START}", "é" + IM_END + "\u0301",
             *(_text(rng, rng.randint(1, 60)) for _ in range(300))]
    for text in texts:
        for add_special in (False, True):
            assert tokenizer.token_ids(text, add_special) == \
                tokenizer.tokenizer.encode(text, add_special_tokens=add_special).ids, text


def _metaspace_tokenizer(scheme: str) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    tokenizer.decoder = decoders.Metaspace(prepend_scheme=scheme)
    tokenizer.train_from_iterator(_corpus(), trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "[INST]"], show_progress=False))
    return tokenizer


def test_a_tokenizer_whose_segments_are_not_independent_is_tokenized_whole() -> None:
    # SentencePiece-style "first": only the text's first piece gets the prefix space, so a
    # segment tokenized on its own would get one it does not have in the whole.
    first = SegmentTokenCache(_metaspace_tokenizer("first"), 1 << 20)
    assert not first.exact and first.ids("a [INST] b", False) is None
    # "always" prefixes every piece: segments are independent again.
    assert SegmentTokenCache(_metaspace_tokenizer("always"), 1 << 20).exact


def test_a_token_that_strips_whitespace_is_left_inside_its_segment(tmp_path: Path) -> None:
    tok = ModelTokenizer.from_dir(write_model_dir(tmp_path))
    tok.tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    tok.enable_cache(1 << 20)
    assert tok.cache is not None and tok.cache.exact
    for text in ("a   <mask> b", f"{IM_START}  <mask>{IM_END}", "<mask>", "x <mask>\n<mask>"):
        assert tok.token_ids(text, False) == tok.tokenizer.encode(text, add_special_tokens=False).ids


def test_memory_is_bounded_and_the_least_recently_used_goes(tmp_path: Path) -> None:
    tok = ModelTokenizer.from_dir(write_model_dir(tmp_path))
    cache = SegmentTokenCache(tok.tokenizer, max_bytes=4000)
    rng = random.Random(1)
    segments = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(40)]
    for segment in segments:
        assert cache.ids(segment + IM_END, False) == \
            tok.tokenizer.encode(segment + IM_END, add_special_tokens=False).ids
        assert cache.bytes <= 4000
    assert 0 < len(cache) < 40
    assert segments[-1] in cache._entries and segments[0] not in cache._entries
    # A segment larger than the whole cache is used, not kept.
    huge = " ".join(WORDS) * 20
    assert cache.ids(huge, False) == tok.tokenizer.encode(huge, add_special_tokens=False).ids
    assert huge not in cache._entries and cache.bytes <= 4000


def test_threads_sharing_the_cache_get_exact_ids(tmp_path: Path) -> None:
    tok = ModelTokenizer.from_dir(write_model_dir(tmp_path))
    tok.enable_cache(64_000)  # small: threads evict each other's segments
    rng = random.Random(5)
    texts = [tok.render_chat(_chat(rng, _text(rng, 100))) for _ in range(60)]
    expected = [tok.tokenizer.encode(t, add_special_tokens=False).ids for t in texts]
    wrong: list[int] = []

    def work(offset: int) -> None:
        for i in range(len(texts)):
            j = (i + offset) % len(texts)
            if tok.token_ids(texts[j], False) != expected[j]:
                wrong.append(j)

    threads = [threading.Thread(target=work, args=(k * 7,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert wrong == []


def test_off_means_tokenized_whole(tmp_path: Path) -> None:
    tok = ModelTokenizer.from_dir(write_model_dir(tmp_path))
    tok.enable_cache(0)
    assert tok.cache is None
    assert tok.token_ids("hello " + IM_END, False) == \
        tok.tokenizer.encode("hello " + IM_END, add_special_tokens=False).ids
