"""The tokenizer rebuilt from GGUF metadata, matching the HF reference id for id: byte-level BPE
(Qwen2, Llama 3, GPT-2 / SmolLM pre-tokenizers: BPE_PRE_TOKENIZERS) and SentencePiece (Llama 2,
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
import dataclasses
import numbers
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from minfer_jax import validate
from minfer_jax.errors import GGUFError, InvalidArgumentError, UnsupportedError
from minfer_jax.files.chat_template import CHATML_TEMPLATE, render_chat_template

# The split regex of Qwen2's tokenizer.json (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2).
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Llama 3's split regex (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3; Meta's tokenizer.json).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp's LLAMA_VOCAB_PRE_TYPE_GPT4O split (gpt-oss's o200k_harmony): case runs split words
# ("CamelCase" -> "Camel", "Case"), contractions stay on their word, digits in threes,
# punctuation takes trailing newlines and '/'. This is llama.cpp's rewrite, not the tokenizer.json
# original it quotes: where they differ (a combining mark after a letter, an upper non-ASCII letter
# after a lower one) this follows llama.cpp (tests/data/llama_cpp/gpt-4o-tokenizer.json).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
GPT4O_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    + _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    + _CONTRACTIONS
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclasses.dataclass(frozen=True)
class BytePairPre:
    """How one `tokenizer.ggml.pre` splits text before byte-level BPE (llama.cpp's pre types, in
    the form of the model's HF tokenizer.json, which llama.cpp's test vectors come from)."""

    split: str | None  # a split regex (isolated), then ByteLevel without its own regex
    digits: bool = False  # single digits first (SmolLM), then ByteLevel with GPT-2's regex
    nfc: bool = False  # NFC-normalize first (Qwen2's tokenizer.json)
    ignore_merges: bool = False  # a pre-token that is itself a token is not merged (Llama 3)
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token


_QWEN2 = BytePairPre(QWEN2_PATTERN, nfc=True)
_LLAMA3 = BytePairPre(LLAMA3_PATTERN, ignore_merges=True, add_bos=True)
_GPT2 = BytePairPre(None)
BPE_PRE_TOKENIZERS = {
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "smollm": BytePairPre(None, digits=True),
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "gpt-4o": BytePairPre(GPT4O_PATTERN),  # gpt-oss (o200k_harmony); no NFC, no BOS
}

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = range(
    1, 7
)

# Control tokens that end a turn in the chat formats this family uses (llama.cpp's EOG names).
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<｜end▁of▁sentence｜>",
    "<end_of_turn>",
    "<EOT>",
    "<|return|>",  # gpt-oss (harmony): the final answer's end
    "<|call|>",  # gpt-oss: a tool call's end
)
# gpt-oss's harmony framing, which llama.cpp always renders (USER_DEFINED, so skip_special keeps
# it): the output's channels are parsed from this text (files/harmony.py). Where the vocabulary
# has <|return|> and <|call|>, <|end|> ends a message, not the turn: not an end token there.
HARMONY_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
HARMONY_END = "<|end|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE tokens are spelled in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_translation() -> dict[int, int]:
    """str.translate table: byte-level character -> code point of its byte (0..255).

    Code points below 256 that are not byte-level characters map to U+0100 so that the
    following latin-1 encode fails for tokens not spelled in the byte-level alphabet.
    """
    table = {ord(ch): b for b, ch in bytes_to_unicode().items()}
    for cp in range(256):
        table.setdefault(cp, 0x100)
    return table


def _token_bytes(tokens: Sequence[str], types: Sequence[int]) -> list[bytes]:
    """The bytes each id stands for: byte-level decoded, or the raw UTF-8 of added tokens.

    A normal token that is not valid byte-level text (never in a well-formed vocab) falls back
    to its UTF-8 spelling rather than vanishing.
    """
    table = _byte_level_translation()
    out = []
    for text, kind in zip(tokens, types):
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            out.append(text.encode("utf-8"))
            continue
        try:
            out.append(text.translate(table).encode("latin-1"))
        except UnicodeEncodeError:
            out.append(text.encode("utf-8"))
    return out


def _spm_token_bytes(tokens: Sequence[str], types: Sequence[int]) -> list[bytes]:
    """SentencePiece ids -> bytes: '▁' is a space, <0xAB> BYTE tokens their byte, the rest UTF-8."""
    out = []
    for text, kind in zip(tokens, types):
        if kind == TOKEN_BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            try:
                out.append(bytes([int(text[3:5], 16)]))
                continue
            except ValueError:
                pass
        out.append(
            (text if kind == TOKEN_CONTROL else text.replace(SPM_SPACE, " ")).encode("utf-8")
        )
    return out


def _optional_bool(meta: Mapping[str, Any], key: str, default: bool, source: str) -> bool:
    value = meta.get(key, default)
    if not isinstance(value, bool):
        raise GGUFError(f"{source}: metadata {key!r} must be a bool, got {value!r:.60}")
    return value


def _require_list(meta: Mapping[str, Any], key: str, item_type: type, source: str) -> list:
    """A metadata array that must exist and hold `item_type` values."""
    value = meta.get(key)
    if not isinstance(value, (list, tuple)):
        raise GGUFError(
            f"{source}: metadata {key!r} must be an array of {item_type.__name__}, "
            f"got {type(value).__name__}"
        )
    for i, item in enumerate(value):
        if not isinstance(item, item_type) or isinstance(item, bool):
            raise GGUFError(
                f"{source}: metadata {key!r} must be an array of {item_type.__name__}, "
                f"but item #{i} is {type(item).__name__} {item!r:.60}"
            )
    return list(value)


def _optional_id(meta: Mapping[str, Any], key: str, n_vocab: int, source: str) -> int | None:
    """A token id from metadata, checked against the vocabulary."""
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n_vocab:
        raise GGUFError(
            f"{source}: metadata {key!r} = {value!r} is not a token id "
            f"(vocabulary has {n_vocab} tokens)"
        )
    return value


def _bpe_pre(meta: Mapping[str, Any], source: str) -> BytePairPre:
    """The pre-tokenizer tokenizer.ggml.pre names; refuse one this package does not know.

    Files converted before llama.cpp wrote the key have none; a Qwen2 file (or one without
    general.architecture) then gets the Qwen2 regex, as it always did.
    """
    arch = meta.get("general.architecture", "qwen2")
    pre = meta.get("tokenizer.ggml.pre", "qwen2" if arch == "qwen2" else None)
    if not isinstance(pre, str) or pre not in BPE_PRE_TOKENIZERS:
        raise UnsupportedError(
            f"{source}: pre-tokenizer {pre!r} is not supported "
            f"(known: {', '.join(sorted(BPE_PRE_TOKENIZERS))})"
        )
    return BPE_PRE_TOKENIZERS[pre]


def _split_merges(merges: list[str], tokens: list[str], source: str) -> list[tuple[str, str]]:
    """'Ġ t' -> ('Ġ', 't'); byte-level tokens never contain a space, so one split is exact.

    Both halves and their join must be tokens: tokenizers panics (a BaseException) on a merge
    whose result is not in the vocabulary.
    """
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    vocab = set(tokens)
    for i, pair in enumerate(pairs):
        if len(pair) != 2:
            raise GGUFError(
                f"{source}: merge #{i} {merges[i]!r} is not two tokens separated by a space"
            )
        for piece in (*pair, pair[0] + pair[1]):
            if piece not in vocab:
                raise GGUFError(
                    f"{source}: merge #{i} {merges[i]!r} needs the token {piece!r}, "
                    "which is not in the vocabulary"
                )
    return pairs


def _build_backend(
    tokens: list[str],
    types: list[int],
    merges: list[tuple[str, str]],
    pre: BytePairPre,
    source: str,
) -> Any:
    """The tokenizers.Tokenizer that encodes byte-level BPE (see module docstring)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = dict(
        zip(tokens, range(len(tokens)))
    )  # duplicate spellings: the last id wins, as in llama.cpp
    try:
        bpe = models.BPE(
            vocab,
            merges,
            unk_token=None,
            byte_fallback=False,
            ignore_merges=pre.ignore_merges,
            fuse_unk=False,
        )
    except Exception as e:
        raise GGUFError(f"{source}: token merges do not fit the vocabulary: {e}") from None
    backend = Tokenizer(bpe)
    if pre.nfc:
        backend.normalizer = normalizers.NFC()
    if pre.split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pre.split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(
                    add_prefix_space=False, trim_offsets=False, use_regex=False
                ),
            ]
        )
    else:  # GPT-2's own regex inside ByteLevel, single digits split off first where asked
        byte_level = pre_tokenizers.ByteLevel(
            add_prefix_space=False, trim_offsets=False, use_regex=True
        )
        backend.pre_tokenizer = (
            pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
            if pre.digits
            else byte_level
        )
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, types)
    return backend


def _add_special_tokens(backend: Any, tokens: list[str], types: list[int]) -> None:
    """CONTROL and USER_DEFINED tokens are matched in text before the model runs."""
    from tokenizers import AddedToken

    # USER_DEFINED tokens (<tool_call>) are matched in text like CONTROL ones but are ordinary
    # text when decoding (HF: special=False; llama.cpp always prints them).
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types)
            if k == TOKEN_CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types)
            if k == TOKEN_USER_DEFINED
        ]
    )


SPM_SPACE = "\u2581"  # SentencePiece's visible space '▁'


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to a SentencePiece vocabulary's scores, as transformers' converter
    (SentencePieceExtractor) derives them: every split of a piece into two pieces, ranked by the
    piece's score (highest first), ties by the halves' ids."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, i in vocab.items():
        local = [
            (piece[:j], piece[j:])
            for j in range(1, len(piece))
            if piece[:j] in vocab and piece[j:] in vocab
        ]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend((scores[i], lr) for lr in local)
    merges.sort(key=lambda m: -m[0])  # stable: ties keep the id order
    return [lr for _, lr in merges]


def _build_spm_backend(
    tokens: list[str],
    types: list[int],
    scores: list[float],
    add_space_prefix: bool,
    unk: str | None,
    source: str,
) -> Any:
    """SentencePiece BPE (`tokenizer.ggml.model = llama`: Llama 2, TinyLlama, Mistral, Gemma) as a
    tokenizers BPE with byte fallback to the <0xXX> tokens, the form of HF's tokenizer.json."""
    from tokenizers import Tokenizer, models, normalizers

    vocab = dict(zip(tokens, range(len(tokens))))
    try:
        bpe = models.BPE(
            vocab, _spm_merges(tokens, scores), unk_token=unk, byte_fallback=True, fuse_unk=True
        )
    except Exception as e:
        raise GGUFError(f"{source}: the SentencePiece vocabulary cannot be built: {e}") from None
    backend = Tokenizer(bpe)
    space = normalizers.Replace(" ", SPM_SPACE)
    # llama.cpp: a space before the text and after every special token (add_space_prefix)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPM_SPACE), space]) if add_space_prefix else space
    )
    _add_special_tokens(backend, tokens, types)
    return backend


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
            _spm_token_bytes(tokens, types) if sentencepiece else _token_bytes(tokens, types)
        )
        self._control_ids = frozenset(i for i, k in enumerate(types) if k == TOKEN_CONTROL)
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
        self.harmony = _is_harmony(tokens)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], source: str = "<gguf>") -> Tokenizer:
        """Build from GGUF `tokenizer.*` metadata; GGUFError/UnsupportedError name `source`.

        tokenizer.ggml.model 'gpt2': byte-level BPE with the pre-tokenizer tokenizer.ggml.pre names;
        'llama': SentencePiece BPE with byte fallback (scores instead of merges)."""
        model = meta.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise UnsupportedError(
                f"{source}: tokenizer model {model!r} is not supported "
                "(only 'gpt2' byte-level BPE and 'llama' SentencePiece BPE)"
            )
        pre = _bpe_pre(meta, source) if model == "gpt2" else None
        tokens = _require_list(meta, "tokenizer.ggml.tokens", str, source)
        if not tokens:
            raise GGUFError(f"{source}: metadata 'tokenizer.ggml.tokens' is empty")
        types = _harmony_types(tokens, _token_types(meta, len(tokens), source))
        bos_id = _optional_id(meta, "tokenizer.ggml.bos_token_id", len(tokens), source)
        eos_id = _optional_id(meta, "tokenizer.ggml.eos_token_id", len(tokens), source)
        # llama.cpp's defaults where the file says nothing: BOS for SentencePiece and Llama 3
        # vocabularies
        add_bos = _optional_bool(
            meta, "tokenizer.ggml.add_bos_token", pre.add_bos if pre else True, source
        )
        add_eos = _optional_bool(meta, "tokenizer.ggml.add_eos_token", False, source)
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
        if pre is not None:
            merges = _split_merges(
                _require_list(meta, "tokenizer.ggml.merges", str, source), tokens, source
            )
            backend = _build_backend(tokens, types, merges, pre, source)
        else:
            scores = _require_list(meta, "tokenizer.ggml.scores", float, source)
            if len(scores) != len(tokens):
                raise GGUFError(f"{source}: {len(scores)} token scores for {len(tokens)} tokens")
            unk_id = _optional_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens), source)
            backend = _build_spm_backend(
                tokens,
                types,
                scores,
                _optional_bool(meta, "tokenizer.ggml.add_space_prefix", True, source),
                None if unk_id is None else tokens[unk_id],
                source,
            )
        return cls(
            backend=backend,
            tokens=tokens,
            types=types,
            bos_id=bos_id,
            add_bos=add_bos,
            eos_id=eos_id,
            eos_ids=_eos_ids(meta, tokens, types, source),
            chat_template=template,
            source=source,
            add_eos=add_eos,
            sentencepiece=pre is None,
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
            table[self._check_id(i)] for i in ids if not (skip_special and i in self._control_ids)
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


def _token_types(meta: Mapping[str, Any], n_vocab: int, source: str) -> list[int]:
    """Per-token types; absent means all NORMAL (llama.cpp's default)."""
    if "tokenizer.ggml.token_type" not in meta:
        return [TOKEN_NORMAL] * n_vocab
    types = _require_list(meta, "tokenizer.ggml.token_type", int, source)
    if len(types) != n_vocab:
        raise GGUFError(f"{source}: {len(types)} token types for {n_vocab} tokens")
    return types


def _is_harmony(tokens: list[str]) -> bool:
    """A harmony vocabulary (gpt-oss): it has <|return|> and <|call|> (llama.cpp's test)."""
    return "<|return|>" in tokens and "<|call|>" in tokens


def _harmony_types(tokens: list[str], types: list[int]) -> list[int]:
    """types with llama.cpp's harmony overrides: the framing tokens USER_DEFINED (rendered), and
    <|end|> too in a harmony vocabulary (not an end token: _eos_ids)."""
    rendered = set(HARMONY_RENDERED) | ({HARMONY_END} if _is_harmony(tokens) else set())
    if not rendered.intersection(tokens):
        return types
    return [TOKEN_USER_DEFINED if t in rendered else k for t, k in zip(tokens, types)]


def _eos_ids(
    meta: Mapping[str, Any], tokens: list[str], types: list[int], source: str
) -> frozenset[int]:
    """Ids that end generation: eos/eot/eom from metadata plus end-of-turn tokens in the vocab.

    Qwen2.5 instruct declares <|im_end|> as eos while its base/FIM use <|endoftext|>; stopping
    on both is what llama.cpp does (its EOG set) and what a chat loop needs.
    """
    ids = set()
    for key in (
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ):
        token_id = _optional_id(meta, key, len(tokens), source)
        if token_id is not None:
            ids.add(token_id)
    wanted = set(END_OF_TURN_TOKENS)
    ids.update(
        i
        for i, (t, k) in enumerate(zip(tokens, types))
        if k in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and t in wanted
    )
    if _is_harmony(tokens):  # llama.cpp drops <|end|> however it got there (eos_token_id too)
        ids.difference_update(i for i in ids.copy() if tokens[i] == HARMONY_END)
    return frozenset(ids)


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
