"""The `tokenizers.Tokenizer` each `tokenizer.ggml.model` builds from a GGUF vocabulary: byte-level
BPE from the file's merges (`gpt2`) and SentencePiece BPE from its scores (`llama`)."""

from __future__ import annotations

from typing import Any

from minfer_jax.errors import GGUFError
from minfer_jax.files.pre_tokenizer import BytePairPre
from minfer_jax.files.vocabulary import SPM_SPACE, TOKEN_CONTROL, TOKEN_USER_DEFINED


def split_merges(merges: list[str], tokens: list[str], source: str) -> list[tuple[str, str]]:
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
    space = normalizers.Replace(" ", SPM_SPACE)
    # llama.cpp: a space before the text and after every special token (add_space_prefix)
    backend.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPM_SPACE), space]) if add_space_prefix else space
    )
    _add_special_tokens(backend, tokens, types)
    return backend
