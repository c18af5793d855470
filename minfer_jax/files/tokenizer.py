"""The tokenizer rebuilt from GGUF metadata, matching the HF reference id for id: byte-level BPE
(Qwen2, Llama 3, GPT-2 / SmolLM pre-tokenizers: pre_tokenizer.py) and SentencePiece (Llama 2,
Gemma).

For Qwen2, encoding is a `tokenizers.Tokenizer` configured as transformers' Qwen2 converter does
it: NFC normalizer, byte-level BPE (no unk, no byte fallback), the Qwen2 split regex (isolated)
followed by ByteLevel(add_prefix_space=False, use_regex=False), and every CONTROL / USER_DEFINED
token of the file as an added token so `<|im_start|>` in text is one id.

Decoding does not use the tokenizers decoder: its ByteLevel decoder silently drops tokens that
are not byte-level strings (e.g. DeepSeek's `<｜end▁of▁sentence｜>`), and streaming must split
text only at UTF-8 character boundaries. Instead every id maps to its bytes once, and both
`decode` and `decode_stream` decode those bytes, so the streamed pieces always join to exactly
what `decode` returns.

Where llama.cpp and HF differ this follows HF, the tokenizer the models were trained with: the
input is NFC-normalized (llama.cpp skips that, so it differs only on non-NFC text), and the
contraction group is the original case-insensitive `(?i:'s|...)` rather than llama.cpp's
rewrite. llama.cpp's test vectors for the qwen2 vocab (tests/data/tokenizer) match exactly.
"""

from __future__ import annotations

import codecs
import numbers
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from minfer_jax import validate
from minfer_jax.errors import GGUFError, InvalidArgumentError
from minfer_jax.files import tokenizer_models, vocabulary
from minfer_jax.files.chat_template import CHATML_TEMPLATE, render_chat_template
from minfer_jax.files.vocabulary import TOKEN_CONTROL, TOKEN_USER_DEFINED


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template; build with `from_metadata`."""

    def __init__(
        self,
        *,
        backend: Any,
        tokens: list[str],
        types: list[int],
        bos_id: int | None,
        add_bos: bool,
        eos_id: int | None,
        eos_ids: frozenset[int],
        chat_template: str,
        source: str,
        add_eos: bool = False,
        sentencepiece: bool = False,
    ) -> None:
        self._backend = backend
        self._tokens = tokens
        self._bytes = (
            vocabulary.spm_token_bytes(tokens, types)
            if sentencepiece
            else vocabulary.token_bytes(tokens, types)
        )
        self._control_ids = frozenset(i for i, k in enumerate(types) if k == TOKEN_CONTROL)
        markers = set(vocabulary.FORMAT_MARKERS)
        # what skip_special drops: control tokens, less the markers a reply is parsed by
        self._skipped_ids = frozenset(i for i in self._control_ids if tokens[i] not in markers)
        # text a prefix's last characters could still turn into (count_at_least): an added token,
        # plus lookahead
        self._unsettled_chars = (
            max(
                (len(t) for t, k in zip(tokens, types) if k in (TOKEN_CONTROL, TOKEN_USER_DEFINED)),
                default=0,
            )
            + 2
        )
        self._literal = None  # the backend with CONTROL tokens as plain text, built on first use
        self._literal_lock = threading.Lock()
        self.bos_id = bos_id
        self._eos_id = eos_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.eos_ids = eos_ids
        self.chat_template = chat_template
        self.source = source
        # gpt-oss's harmony vocabulary: its chat output has channels (files/harmony.py)
        self.harmony = vocabulary.is_harmony(tokens)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], source: str = "<gguf>") -> Tokenizer:
        """Build from GGUF `tokenizer.*` metadata; GGUFError/UnsupportedError name `source`.

        tokenizer.ggml.model 'gpt2': byte-level BPE with the pre-tokenizer tokenizer.ggml.pre names;
        'llama': SentencePiece BPE with byte fallback (scores instead of merges); 'gemma4':
        '▁'-spelled BPE from merges with byte fallback (tokenizer_models.py)."""
        tokens = vocabulary.require_list(meta, "tokenizer.ggml.tokens", str, source)
        if not tokens:
            raise GGUFError(f"{source}: metadata 'tokenizer.ggml.tokens' is empty")
        types = vocabulary.harmony_types(tokens, vocabulary.token_types(meta, len(tokens), source))
        built = tokenizer_models.build(meta, tokens, types, source)
        bos_id = vocabulary.optional_id(meta, "tokenizer.ggml.bos_token_id", len(tokens), source)
        eos_id = vocabulary.optional_id(meta, "tokenizer.ggml.eos_token_id", len(tokens), source)
        # llama.cpp's defaults where the file says nothing: BOS for SentencePiece and Llama 3
        # vocabularies; Gemma 4 always
        add_bos = (
            vocabulary.optional_bool(meta, "tokenizer.ggml.add_bos_token", built.add_bos, source)
            or built.always_bos
        )
        add_eos = vocabulary.optional_bool(meta, "tokenizer.ggml.add_eos_token", False, source)
        for flag, key, token_id in (
            (add_bos, "add_bos_token", bos_id),
            (add_eos, "add_eos_token", eos_id),
        ):
            if flag and token_id is None:
                raise GGUFError(f"{source}: {key} is set but there is no {key[4:7]}_token_id")
        template = meta.get("tokenizer.chat_template") or CHATML_TEMPLATE
        if not isinstance(template, str):
            raise GGUFError(
                f"{source}: metadata 'tokenizer.chat_template' must be a string, "
                f"got {type(template).__name__}"
            )
        return cls(
            backend=built.backend,
            tokens=tokens,
            types=types,
            bos_id=bos_id,
            add_bos=add_bos,
            eos_id=eos_id,
            eos_ids=vocabulary.eos_ids(meta, tokens, types, source),
            chat_template=template,
            source=source,
            add_eos=add_eos,
            sentencepiece=built.spm_spelling,
        )

    @classmethod
    def from_model(cls, model: Any) -> Tokenizer:
        """Build from a loaded `minfer_jax.model.gguf_model.GGUFModel`."""
        return cls.from_metadata(model.metadata, source=str(model.path))

    def backend_json(self) -> str:
        """The HF `tokenizers` backend serialized (tokenizer.json), for grammar libraries."""
        return self._backend.to_str()

    @property
    def vocab_size(self) -> int:
        """Number of ids (= rows of the embedding table), including added/control tokens."""
        return len(self._tokens)

    @property
    def eos_id(self) -> int | None:
        """The file's declared eos id (generation should stop on any of `eos_ids`)."""
        return self._eos_id

    def token_to_id(self, token: str) -> int | None:
        """Id of a token spelled as in the vocabulary (byte-level, e.g. 'Ġhello'), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """Vocabulary spelling of an id (byte-level for normal tokens)."""
        return self._tokens[self._check_id(token_id)]

    def is_control(self, token_id: int) -> bool:
        """Whether the id is a CONTROL token (<|im_start|>, <|endoftext|>, ...)."""
        return token_id in self._control_ids

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; special-token text inside it becomes the special ids.

        add_special prepends BOS when the file asks for it (add_bos_token; false for Qwen,
        true for DeepSeek-R1-Distill). Text already rendered by a chat template that starts
        with `bos_token` should be encoded with add_special=False, as transformers does.
        parse_special=False keeps CONTROL-token text literal (`<|im_start|>` typed by a user
        becomes the tokens of its characters, so it cannot forge a role boundary); USER_DEFINED
        tokens such as `<tool_call>` still match, as in transformers' split_special_tokens.
        """
        validate.text("the text to encode", text)
        ids = self._run(self._backend if parse_special else self._literal_backend(), text).ids
        if add_special and self.add_bos:
            ids.insert(0, self.bos_id)
        if add_special and self.add_eos:
            ids.append(self._eos_id)
        return ids

    def count_at_least(self, prefix: str, parse_special: bool = True) -> int:
        """A lower bound on the tokens of any text that starts with `prefix` (what encode would
        give it with add_special=False): its tokens, less those of the pre-tokens reaching into
        its last few characters, which more text could merge, split or complete into an added
        token. Lets a caller refuse a huge prompt after encoding only a prefix of it."""
        validate.text("the text to encode", prefix)
        enc = self._run(self._backend if parse_special else self._literal_backend(), prefix)
        settled_end = len(prefix) - self._unsettled_chars
        words = enc.word_ids
        for j, (_, end) in enumerate(enc.offsets):
            if (
                end > settled_end
            ):  # the first token that may change; its pre-token's earlier tokens too
                while j > 0 and words[j] is not None and words[j - 1] == words[j]:
                    j -= 1
                return j
        return len(enc.ids)

    def _run(self, backend: Any, text: str) -> Any:
        try:
            return backend.encode(text, add_special_tokens=False)
        except (
            BaseException
        ) as e:  # tokenizers' PanicException is a BaseException: the vocab is broken
            if type(e).__name__ != "PanicException":
                raise
            raise GGUFError(
                f"{self.source}: the tokenizer failed on this text ({e}); its vocabulary or merges "
                "are inconsistent"
            ) from None

    def _literal_backend(self) -> Any:
        with self._literal_lock:
            if self._literal is None:
                from tokenizers import Tokenizer as Backend

                literal = Backend.from_str(self._backend.to_str())
                # special=True added tokens (CONTROL) split as text
                literal.encode_special_tokens = True
                self._literal = literal
            return self._literal

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
        return self.token_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def token_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """Raw bytes of `ids` (a single token can be part of a UTF-8 character)."""
        table = self._bytes
        return b"".join(
            table[self._check_id(i)] for i in ids if not (skip_special and i in self._skipped_ids)
        )

    def decode_stream(self, skip_special: bool = False) -> DecodeStream:
        """An incremental detokenizer for printing tokens as they are generated."""
        return DecodeStream(self, skip_special=skip_special)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render the file's chat template (ChatML when it has none) for `messages`."""
        specials = {
            "bos_token": self._spelling(self.bos_id),
            "eos_token": self._spelling(self._eos_id),
        }
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            **{**specials, **extra},
        )

    def _spelling(self, token_id: int | None) -> str:
        return "" if token_id is None else self._tokens[token_id]

    def _check_id(self, token_id: int) -> int:
        """Reject ids outside the vocabulary (a negative id would silently index from the end)."""
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
            raise InvalidArgumentError(
                f"token id must be an int, got {token_id!r:.60} ({type(token_id).__name__})"
            )
        i = int(token_id)
        if not 0 <= i < len(self._tokens):
            raise InvalidArgumentError(
                f"token id {i} is outside the vocabulary (0..{len(self._tokens) - 1})"
            )
        return i

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.source!r}, vocab_size={self.vocab_size}, "
            f"eos_ids={sorted(self.eos_ids)})"
        )


class DecodeStream:
    """Turns ids, one at a time, into text pieces that never end inside a UTF-8 character.

    A byte-level token may hold half of a character (CJK, emoji); its bytes wait in a UTF-8
    incremental decoder until the character is complete. The pieces joined (with `finish()`)
    equal `Tokenizer.decode` of the same ids.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        """Text completed by this token ('' while a character is still incomplete)."""
        return self._utf8.decode(self._tokenizer.token_bytes([token_id], self._skip_special))

    def feed(self, ids: Iterable[int]) -> str:
        """Text completed by several tokens."""
        return self._utf8.decode(self._tokenizer.token_bytes(ids, self._skip_special))

    def finish(self) -> str:
        """Flush at end of generation: a dangling partial character becomes U+FFFD."""
        return self._utf8.decode(b"", final=True)
