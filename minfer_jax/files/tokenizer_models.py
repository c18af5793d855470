"""The `tokenizers.Tokenizer` each `tokenizer.ggml.model` builds from a GGUF vocabulary: byte-level
BPE from the file's merges (`gpt2`), SentencePiece BPE from its scores (`llama`), and Gemma 4's
SentencePiece-style BPE from its merges (`gemma4`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from minfer_jax.errors import GGUFError, UnsupportedError
from minfer_jax.files import vocabulary
from minfer_jax.files.pre_tokenizer import BytePairPre, byte_pair_pre
from minfer_jax.files.vocabulary import SPM_SPACE, TOKEN_CONTROL, TOKEN_USER_DEFINED

# Gemma 4's split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_GEMMA4): merges run over each line and each
# run of newlines, never across a newline.
GEMMA4_SPLIT = r"[^\n]+|[\n]+"


@dataclasses.dataclass(frozen=True)
class TokenizerModel:
    """What one `tokenizer.ggml.model` built: the backend and the defaults that come with it."""

    backend: Any  # a tokenizers.Tokenizer
    add_bos: bool  # llama.cpp's default where the file has no add_bos_token
    spm_spelling: bool  # ids spell a space '▁' and a byte <0xXX> (not byte-level characters)
    always_bos: bool = False  # llama.cpp adds BOS whatever the file says (Gemma 4)


def build(
    meta: Mapping[str, Any], tokens: list[str], types: list[int], source: str
) -> TokenizerModel:
    """The backend of the file's tokenizer.ggml.model; UnsupportedError for another model."""
    model = meta.get("tokenizer.ggml.model")
    if model == "gpt2":
        pre = byte_pair_pre(meta, source)
        backend = build_byte_level_bpe(tokens, types, _merges(meta, tokens, source), pre, source)
        return TokenizerModel(backend, add_bos=pre.add_bos, spm_spelling=False)
    if model == "gemma4":
        backend = build_gemma4_bpe(tokens, types, _merges(meta, tokens, source), source)
        return TokenizerModel(backend, add_bos=True, spm_spelling=True, always_bos=True)
    if model == "llama":
        scores = vocabulary.require_list(meta, "tokenizer.ggml.scores", float, source)
        if len(scores) != len(tokens):
            raise GGUFError(f"{source}: {len(scores)} token scores for {len(tokens)} tokens")
        unk_id = vocabulary.optional_id(
            meta, "tokenizer.ggml.unknown_token_id", len(tokens), source
        )
        backend = build_sentencepiece_bpe(
            tokens,
            types,
            scores,
            vocabulary.optional_bool(meta, "tokenizer.ggml.add_space_prefix", True, source),
            None if unk_id is None else tokens[unk_id],
            source,
        )
        return TokenizerModel(backend, add_bos=True, spm_spelling=True)
    raise UnsupportedError(
        f"{source}: tokenizer model {model!r} is not supported (only 'gpt2' byte-level BPE, "
        "'llama' SentencePiece BPE and 'gemma4')"
    )


def _merges(meta: Mapping[str, Any], tokens: list[str], source: str) -> list[tuple[str, str]]:
    return split_merges(
        vocabulary.require_list(meta, "tokenizer.ggml.merges", str, source), tokens, source
    )


def split_merges(merges: list[str], tokens: list[str], source: str) -> list[tuple[str, str]]:
    """'Ġ t' -> ('Ġ', 't') at the first space after the first character, as llama.cpp splits;
    byte-level and '▁'-spelled tokens never contain a space, so that split is exact.

    Both halves and their join must be tokens: tokenizers panics (a BaseException) on a merge
    whose result is not in the vocabulary.
    """
    pairs = [_split_merge(m) for m in merges]
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


def _split_merge(merge: str) -> tuple[str, ...]:
    at = merge.find(" ", 1)
    return (merge,) if at < 0 else (merge[:at], merge[at + 1 :])


def build_byte_level_bpe(
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


def _spm_decoder() -> Any:
    """HF's decoder for '▁'-spelled vocabularies: not used to decode here (vocabulary.py's bytes
    are), but llguidance reads each token's bytes from it (backend_json)."""
    from tokenizers import decoders

    return decoders.Sequence(
        [decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )


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


def build_sentencepiece_bpe(
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
    backend.decoder = _spm_decoder()
    space = normalizers.Replace(" ", SPM_SPACE)
    # llama.cpp: a space before the text and after every special token (add_space_prefix)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPM_SPACE), space]) if add_space_prefix else space
    )
    _add_special_tokens(backend, tokens, types)
    return backend


def build_gemma4_bpe(
    tokens: list[str], types: list[int], merges: list[tuple[str, str]], source: str
) -> Any:
    """Gemma 4's tokenizer as llama.cpp runs it (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_GEMMA4): a
    space becomes '▁' (no space before the text), the text splits into lines and newline runs,
    the file's merges run on the UTF-8 characters of each, and a character no token holds falls
    back to its <0xXX> byte tokens."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

    vocab = dict(zip(tokens, range(len(tokens))))
    try:
        bpe = models.BPE(vocab, merges, unk_token=None, byte_fallback=True, fuse_unk=False)
    except Exception as e:
        raise GGUFError(f"{source}: token merges do not fit the vocabulary: {e}") from None
    backend = Tokenizer(bpe)
    backend.decoder = _spm_decoder()
    backend.normalizer = normalizers.Replace(" ", SPM_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(
        Regex(GEMMA4_SPLIT), behavior="isolated", invert=False
    )
    _add_special_tokens(backend, tokens, types)
    return backend
