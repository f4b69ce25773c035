"""The exact index (pure) and tokenizer-aware request hashing, with a tokenizer built locally."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from router.config import PrefixConfig
from router.kv_index import DECODER, AllBlocksCleared, BlockRemoved, BlockStored, ExactIndex, KVEventBatch
from router.prefix import chain_token_hashes
from router.request import BadRequest, parse_request
from router.tokenize import Tokenization

P = 4  # page size


def pages(ids, parent=None, base=1000, medium=None):
    """A BlockStored chain for ``ids`` with made-up engine hashes base, base+1, ..."""
    n = len(ids) // P
    return BlockStored([base + i for i in range(n)], parent, list(ids[: n * P]), P, medium=medium)


def batch(*events):
    return KVEventBatch(0.0, list(events))


def test_stored_pages_match_the_request_page_hashes_removed_and_cleared_ones_do_not():
    idx = ExactIndex(P)
    ids = list(range(1, 25))  # 6 pages
    h = chain_token_hashes(ids, P)
    idx.apply("w", batch(pages(ids[:12])))  # 3 pages, parent = root
    assert idx.match("w", h) == 3 and idx.match("x", h) == 0
    idx.apply("w", batch(BlockStored([2000, 2001], 1002, ids[12:20], P)))  # a child chain of page 3
    assert idx.match("w", h) == 5
    idx.apply("w", batch(BlockRemoved([2001])))
    assert idx.match("w", h) == 4
    idx.apply("w", batch(BlockStored([3000], 999_999, ids[20:24], P)))  # unknown parent: skipped
    assert idx.match("w", h) == 4 and idx.skipped == 1
    idx.apply("w", batch(AllBlocksCleared()))
    assert idx.match("w", h) == 0 and idx.size("w") == 0


def test_media_partial_pages_namespaces_and_page_size_mismatch():
    idx = ExactIndex(P)
    ids = list(range(1, 17))
    h = chain_token_hashes(ids, P)
    idx.apply("w", batch(pages(ids[:8], medium="CPU_PINNED")))
    assert idx.match("w", h) == 2 and idx.size("w", "CPU_PINNED") == 2 and idx.size("w", "GPU") == 0
    idx.apply("w", batch(BlockRemoved([1000, 1001], medium="GPU")))  # not on GPU: still held on CPU
    assert idx.match("w", h) == 2
    # a chain whose last page is partial: the full pages count
    idx.apply("w", batch(BlockStored([5000, 5001], 1001, ids[8:14], P)))
    assert idx.match("w", h) == 3
    idx.apply("v", batch(BlockStored([1, 2], None, ids[:8], P, lora_name="adapter")))
    assert idx.match("v", h) == 0
    idx.apply("u", batch(BlockStored(list(range(8)), None, ids[:8], 1)))  # engine page size 1
    assert idx.match("u", h) == 0 and idx.page_size_mismatch == 8


def test_batches_decode_from_msgpack_like_sglang_sends_them():
    import msgspec

    enc = msgspec.msgpack.Encoder()
    raw = enc.encode(batch(pages(list(range(8))), BlockRemoved([1000]), AllBlocksCleared()))
    got = DECODER.decode(raw)
    assert [type(e).__name__ for e in got.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    with pytest.raises(msgspec.DecodeError):
        DECODER.decode(b"\xc1 not msgpack")


WORDS = ["<s>", "<|", "|>", "user", "assistant", "system", "tools", "you", "are", "a", "helpful", "bot",
         "hello", "there", "how", "is", "the", "weather", "today", "in", "paris", "tell", "me", "more",
         "about", "caches", "and", "routers", "please", "thanks", "get_weather", "[", "]", "{", "}", ":", ",",
         '"', "name", "what", "time"]
TEMPLATE = ("{% if tools %}<| tools |> {{ tools | tojson }} {% endif %}"
            "{% for m in messages %}<| {{ m.role }} |> {{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}<| assistant |>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<s>"}))
    return d


def test_requests_are_hashed_by_the_workers_token_ids(tokenizer_dir):
    tok = Tokenization.load(str(tokenizer_dir))
    cfg = PrefixConfig(block_tokens=8, page_tokens=P, tokenizer_path=str(tokenizer_dir))
    text = "hello there how is the weather today in paris tell me more about caches and routers"
    p = parse_request("/v1/completions", {"prompt": text}, cfg, tok)
    ids = tok.encode_prompt(text)
    assert ids[0] == 1 and p.n_tokens == len(ids) == 17  # <s> + 16 words
    assert p.page_hashes == chain_token_hashes(ids, P) and len(p.page_hashes) == 4
    assert p.hashes == p.page_hashes[1::2]  # the approximate index keeps every second page hash
    # the same ids given directly hash the same
    assert parse_request("/generate", {"input_ids": ids}, cfg, tok).page_hashes == p.page_hashes
    # chat requests go through the chat template, tools and all
    msgs = [{"role": "system", "content": "you are a helpful bot"}, {"role": "user", "content": "hello there"}]
    tools = [{"name": "get_weather"}]
    c = parse_request("/v1/chat/completions", {"messages": msgs, "tools": tools}, cfg, tok)
    want = tok.tokenizer.encode(tok.template.render(messages=msgs, tools=tools, add_generation_prompt=True),
                                add_special_tokens=False).ids
    assert c.n_tokens == len(want) and c.page_hashes == chain_token_hashes(want, P)
    assert c.page_hashes != parse_request("/v1/chat/completions", {"messages": msgs}, cfg, tok).page_hashes


def test_tokenizer_and_template_errors(tmp_path, tokenizer_dir):
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        Tokenization.load(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    with pytest.raises(ValueError, match="does not parse"):
        Tokenization.load(str(tokenizer_dir / "tokenizer.json"), str(bad))
    refuse = tmp_path / "refuse.jinja"
    refuse.write_text("{{ raise_exception('roles must alternate') }}")
    tok = Tokenization.load(str(tokenizer_dir / "tokenizer.json"), str(refuse))
    cfg = PrefixConfig(block_tokens=8, page_tokens=P, tokenizer_path=str(tokenizer_dir))
    with pytest.raises(BadRequest, match="roles must alternate"):
        parse_request("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, cfg, tok)
    with pytest.raises(ValueError, match="multiple of page_tokens"):
        PrefixConfig(block_tokens=10, page_tokens=4)
