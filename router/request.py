"""Turn a request body into what routing needs: block hashes, token estimate, media keys.

Pure. Understands OpenAI ``/v1/completions`` (``prompt``), ``/v1/chat/completions``
(``messages``, text and multimodal parts) and SGLang ``/generate`` (``text`` or
``input_ids``, ``image_data``/``audio_data``/``video_data``). Token ids are hashed
in blocks of ``block_tokens``; text in chunks of ``block_tokens * chars_per_token``
characters, with tokens estimated as ``len(text) / chars_per_token``. A batch (a list of
prompts: ``prompt``, ``text``, or ``input_ids`` as a list of token lists) is routed by its
longest prompt, the one that decides which workers can take it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import xxhash

from router.config import PrefixConfig
from router.prefix import chain_text_hashes, chain_token_hashes
from router.tokenize import TemplateError, Tokenization


class BadRequest(ValueError):
    """The body cannot be routed; the message is sent back to the client with a 400."""


MAX_TOKEN_ID = (1 << 63) - 1


def utf8(text: str, what: str) -> bytes:
    """``text`` as UTF-8; a lone UTF-16 surrogate (JSON ``"\\ud800"``) is a BadRequest."""
    try:
        return text.encode()
    except UnicodeEncodeError as e:
        raise BadRequest(f"{what} contains a lone UTF-16 surrogate ({text[e.start]!r} at character {e.start}), "
                         "which is not valid Unicode; send well-formed text") from None


# not frozen: built per request, and a frozen dataclass costs several times as much to build
@dataclass(slots=True)
class ParsedRequest:
    hashes: list[int]  # blocks of the approximate index (block_tokens each)
    n_tokens: int
    media_keys: list[str] = field(default_factory=list)
    stream: bool = False
    model: str | None = None
    page_hashes: list[int] = field(default_factory=list)  # pages of the exact index (page_tokens each)
    token_ids: list[int] | None = field(default=None, repr=False)  # when known (given, or tokenized)
    # a prompt shorter than one block has no hash: it breaks ties between equal workers by a hash
    # of its whole text / ids instead (else every short prompt went to the same worker)
    short_key: int = 0

    @property
    def tie_key(self) -> int:
        """What breaks ties between equal workers: the last block's hash (one prefix, one worker)."""
        return self.hashes[-1] if self.hashes else self.short_key

    @property
    def n_blocks(self) -> int:
        return len(self.hashes)


_MEDIA_PARTS = {"image_url": "url", "video_url": "url", "audio_url": "url", "input_audio": "data"}


def parse_request(path: str, body: object, cfg: PrefixConfig, tok: Tokenization | None = None) -> ParsedRequest:
    """Extract routing inputs from a decoded JSON body. Raises BadRequest with a clear message.

    With page_tokens set, token ids (the request's own, or ``tok``'s) are hashed per page;
    without, text is cut into chunks of block_tokens x chars_per_token characters."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    if model is not None:
        utf8(model, "'model'")
    r = _Req(cfg, tok, bool(body.get("stream", False)), model)
    if path.endswith("/chat/completions"):
        messages, tools = body.get("messages"), body.get("tools")
        text = _chat_text(messages, tools, r.media)
        if tok is not None:
            try:
                ids = tok.encode_chat(messages, tools)  # type: ignore[arg-type]  # _chat_text checked it
            except TemplateError as e:
                raise BadRequest(str(e)) from None
            if ids is not None:
                return r.from_ids(ids)
        return r.from_text(text)
    if path.endswith("/completions"):
        return r.from_batch(body.get("prompt"), "prompt")
    # SGLang /generate
    for k in ("image_data", "audio_data", "video_data"):
        v = body.get(k)
        for item in v if isinstance(v, list) else [v]:
            if isinstance(item, str) and item:
                r.media.append(_media_key(item))
    if "input_ids" in body:
        return r.from_batch(body["input_ids"], "input_ids")
    return r.from_batch(body.get("text"), "text")


class _Req:
    def __init__(self, cfg: PrefixConfig, tok: Tokenization | None, stream: bool, model: str | None) -> None:
        self.cfg, self.tok, self.stream, self.model = cfg, tok, stream, model
        self.media: list[str] = []

    def from_batch(self, prompt: object, name: str) -> ParsedRequest:
        """One prompt, or a batch of them (a list of strings or of token lists): the longest,
        picked by length before anything is hashed (hashing all 400,000 prompts of a 30 MB batch
        held the event loop 2.5 s, every other client with it)."""
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            return self.from_prompt(max(prompt, key=len), name)
        return self.from_prompt(prompt, name)

    def from_prompt(self, prompt: object, name: str) -> ParsedRequest:
        if isinstance(prompt, str):
            if self.tok is not None:
                utf8(prompt, "the prompt")
                return self.from_ids(self.tok.encode_prompt(prompt))
            return self.from_text(prompt)
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            if prompt and not 0 <= min(prompt) <= max(prompt) <= MAX_TOKEN_ID:
                raise BadRequest(f"'{name}' token ids must be integers in [0, 2^63 - 1]")
            return self.from_ids(prompt)
        raise BadRequest(f"'{name}' must be a string or a list of integer token ids")

    def from_ids(self, ids: list[int]) -> ParsedRequest:
        page = self.cfg.page_tokens
        if page:
            pages = chain_token_hashes(ids, page)
            k = self.cfg.block_tokens // page
            blocks = pages[k - 1 :: k]
            return ParsedRequest(blocks, len(ids), self.media, self.stream, self.model, pages, ids,
                                 short_key=0 if blocks else _short_key(np.asarray(ids, dtype=np.int64).tobytes()))
        hashes = chain_token_hashes(ids, self.cfg.block_tokens)
        return ParsedRequest(hashes, len(ids), self.media, self.stream, self.model,
                             short_key=0 if hashes else _short_key(np.asarray(ids, dtype=np.int64).tobytes()))

    def from_text(self, text: str) -> ParsedRequest:
        utf8(text, "the prompt")
        hashes = chain_text_hashes(text, self.cfg.block_tokens * self.cfg.chars_per_token)
        return ParsedRequest(hashes, len(text) // self.cfg.chars_per_token, self.media, self.stream, self.model,
                             short_key=0 if hashes else _short_key(text.encode()))


def _short_key(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=2) & ((1 << 63) - 1)


def _chat_text(messages: object, tools: object, media: list[str]) -> str:
    """The text the approximate index hashes for a chat request (tools and tool calls included);
    it also validates the messages and collects media keys."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects")
    parts: list[str] = []
    if tools is not None:
        parts.append(f"<|tools|>{json.dumps(tools, sort_keys=True)}")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise BadRequest("each message must be an object with 'role' and 'content'")
        parts.append(f"<|{m['role']}|>")
        content = m.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for p in content:
                if not isinstance(p, dict):
                    raise BadRequest("message content parts must be objects with a 'type'")
                kind = p.get("type")
                if kind == "text":
                    parts.append(str(p.get("text", "")))
                elif kind in _MEDIA_PARTS:
                    ref = p.get(kind)
                    val = ref.get(_MEDIA_PARTS[kind]) if isinstance(ref, dict) else ref
                    if isinstance(val, str) and val:
                        key = _media_key(val)
                        media.append(key)
                        parts.append(f"<|media:{key}|>")
        elif content is not None:
            raise BadRequest("message 'content' must be a string or a list of parts")
        if m.get("tool_calls") is not None:
            parts.append(f"<|tool_calls|>{json.dumps(m['tool_calls'], sort_keys=True)}")
    return "\n".join(parts)


def _media_key(data: str) -> str:
    """Content hash of an inline media payload, or of the URL for a reference."""
    return xxhash.xxh3_128_hexdigest(utf8(data, "a media item"))
