"""A GGUF's tokenizer, rebuilt from its metadata through public, versioned APIs only.

A GGUF carries no `tokenizer.json`: llama.cpp's converter stores the vocabulary, merges,
token types, special ids and flags as metadata (`tokenizer.ggml.*`). We read those with the
`gguf` package's `GGUFReader`, assemble a `tokenizers.Tokenizer` from that library's public
models, normalizers, pre-tokenizers and decoders, and wrap it in
`transformers.PreTrainedTokenizerFast(tokenizer_object=...)`, so callers keep `encode`,
`decode` and `apply_chat_template`. transformers' own GGUF integration is private, and its
location and contents change between releases; nothing here uses it.

`tokenizer.ggml.model`:
  "gpt2"  byte-level BPE (SmolLM2, Qwen3, Llama-3, gpt-oss). The split before BPE depends on
          `tokenizer.ggml.pre` (`PRE_TOKENIZERS`, the model's own tokenizer.json pattern);
          an unknown name falls back to GPT-2's split, with a warning.
  "llama" SentencePiece BPE (Llama-2, Mistral, TinyLlama): the file's merges, or merges
          derived from the token scores; metaspace (`tokenizer.ggml.add_space_prefix`) and
          byte fallback, as transformers' `LlamaTokenizerFast` builds it.
Anything else ("bert", "t5", "rwkv", ...) raises `UnsupportedTokenizer`; `tokenizer_from_gguf`
turns that into a warning and `None`: the model still loads, and prompts are token ids.

Import-light on purpose: numpy and `tokenizers`, plus `transformers` and `gguf` inside the
functions; nothing from jax or the rest of vegas_jax, so the file can be loaded by path in a
small environment (`tests/gguf_tokenizer_check.py` does, for CI's oldest transformers).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

# llama.cpp token types (gguf.TokenType)
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4

# Split patterns, as in each model's tokenizer.json (and llama.cpp's llama-vocab.cpp).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclasses.dataclass(frozen=True)
class Pre:
    """How a byte-level vocabulary splits text before BPE."""

    split: str | None = None  # regex, isolated; None: ByteLevel's own GPT-2 pattern
    digits: bool = False  # each digit its own piece first (StarCoder, SmolLM)
    nfc: bool = False  # NFC-normalize first (Qwen2's tokenizer.json does)
    ignore_merges: bool = False  # a piece that is a whole token is that token (tiktoken-made)


_GPT2_PRE = Pre()
PRE_TOKENIZERS = {
    "gpt2": _GPT2_PRE, "gpt-2": _GPT2_PRE,
    "smollm": Pre(digits=True), "starcoder": Pre(digits=True), "refact": Pre(digits=True),
    "llama-bpe": Pre(_LLAMA3, ignore_merges=True), "llama3": Pre(_LLAMA3, ignore_merges=True),
    "llama-v3": Pre(_LLAMA3, ignore_merges=True),
    "qwen2": Pre(_QWEN2, nfc=True),
    "gpt-4o": Pre(_O200K, ignore_merges=True),  # gpt-oss
}


class UnsupportedTokenizer(ValueError):
    """The GGUF describes a tokenizer this module cannot build."""


def field(reader, key: str, default: Any = None) -> Any:
    """A metadata value as Python (str, int, float, bool or a list of them).

    `ReaderField.contents()` where the gguf package has it (0.16+), else decoded from the
    field's `parts` / `data` (the reader's layout since gguf 0.1)."""
    f = reader.fields.get(key)
    if f is None:
        return default
    if hasattr(f, "contents"):
        return f.contents()
    from gguf import GGUFValueType

    def one(part, kind):
        return bytes(part).decode("utf-8") if kind == GGUFValueType.STRING else part.tolist()[0]

    if f.types and f.types[0] == GGUFValueType.ARRAY:
        return [one(f.parts[i], f.types[-1]) for i in f.data]
    return one(f.parts[-1], f.types[0]) if f.types else None


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet of byte-level vocabularies)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # a repeated spelling keeps its first id, as llama.cpp does
    if len(vocab) != len(tokens):
        warnings.warn(f"GGUF vocabulary repeats {len(tokens) - len(vocab)} token spellings; "
                      "their later ids are unreachable by encoding")
    return vocab


def _merges(merges: list[str] | None, vocab: dict[str, int], scores: list[float] | None):
    """The file's merges, or, where it has none, the pairs its vocabulary implies: every split
    of a token into two tokens, best-first by that token's score (SentencePiece BPE) or, with
    no scores, by its id."""
    if merges:
        return [tuple(m.split(" ", 1)) for m in merges]
    rank = (lambda t: -scores[vocab[t]]) if scores else (lambda t: vocab[t])
    out = []
    for tok in sorted(vocab, key=rank):
        pairs = [(tok[:i], tok[i:]) for i in range(1, len(tok))
                 if tok[:i] in vocab and tok[i:] in vocab]
        out.extend(sorted(pairs, key=lambda p: (vocab[p[0]], vocab[p[1]])))
    return out


def _added(tokens, types, kinds_special, kinds_plain):
    from tokenizers import AddedToken

    out = []
    for tok, kind in zip(tokens, types or ()):
        if kind in kinds_special or kind in kinds_plain:
            out.append(AddedToken(tok, special=kind in kinds_special, normalized=False))
    return out


def _gpt2(meta: dict):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, processors
    from tokenizers import pre_tokenizers

    pre_name = meta.get("pre")
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        warnings.warn(f"GGUF pre-tokenizer {pre_name!r} is not one we know "
                      f"({sorted(PRE_TOKENIZERS)}); splitting text as GPT-2 does, so some "
                      "texts may encode differently from the model's own tokenizer")
        pre = _GPT2_PRE
    tokens, types = meta["tokens"], meta.get("token_type") or [1] * len(meta["tokens"])
    # Ordinary tokens are spelled in the byte alphabet; added ones (control, user-defined)
    # are stored as their text, and stay so: the added vocabulary finds them by that text.
    alphabet = _byte_alphabet()
    chars = set(alphabet.values())
    spelled = [t if k in (CONTROL, USER_DEFINED) or set(t) <= chars
               else "".join(alphabet[b] for b in t.encode("utf-8"))
               for t, k in zip(tokens, types)]
    vocab = _vocab(spelled)
    bpe = models.BPE(vocab=vocab, merges=_merges(meta.get("merges"), vocab, None),
                     fuse_unk=False, byte_fallback=False, ignore_merges=pre.ignore_merges)
    tok = Tokenizer(bpe)
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    steps = []
    if pre.split is not None:
        steps.append(pre_tokenizers.Split(Regex(pre.split), behavior="isolated", invert=False))
    if pre.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                          use_regex=pre.split is None))
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_added(tokens, types, {CONTROL}, ()))
    tok.add_tokens(_added(tokens, types, (), {USER_DEFINED}))
    _post(tok, meta, processors.ByteLevel(trim_offsets=False))
    return tok


def _spm(meta: dict):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens, types = meta["tokens"], meta.get("token_type")
    vocab = _vocab(tokens)
    unk = meta.get("unk_token")
    bpe = models.BPE(vocab=vocab, merges=_merges(meta.get("merges"), vocab, meta.get("scores")),
                     unk_token=unk, fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(bpe)
    prefix = meta.get("add_space_prefix", True)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens(_added(tokens, types, {UNKNOWN, CONTROL}, ()))
    tok.add_tokens(_added(tokens, types, (), {USER_DEFINED}))
    _post(tok, meta, None)
    return tok


def _post(tok, meta: dict, default):
    """BOS / EOS added on encode exactly when the file says so."""
    from tokenizers import processors

    add = [(s, meta[f"{s}_token"], meta[f"{s}_id"]) for s in ("bos", "eos")
           if meta.get(f"add_{s}") and meta.get(f"{s}_token") is not None]
    if not add:
        if default is not None:
            tok.post_processor = default
        return
    bos = [f"{t}:0" for s, t, _ in add if s == "bos"]
    eos = [f"{t}:0" for s, t, _ in add if s == "eos"]
    single = " ".join([*bos, "$A:0", *eos])
    pair = " ".join([single, *[b.replace(":0", ":1") for b in bos], "$B:1",
                     *[e.replace(":0", ":1") for e in eos]])
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, i) for _, t, i in add])


def metadata(reader) -> dict | None:
    """The tokenizer part of a GGUF's metadata, under short names; None with no vocabulary."""
    g = lambda k, d=None: field(reader, f"tokenizer.ggml.{k}", d)  # noqa: E731
    tokens = g("tokens")
    if not tokens:
        return None
    meta = dict(model=g("model"), pre=g("pre"), tokens=tokens, token_type=g("token_type"),
                merges=g("merges"), scores=g("scores"), add_space_prefix=g("add_space_prefix"),
                add_bos=g("add_bos_token"), add_eos=g("add_eos_token", False),
                chat_template=field(reader, "tokenizer.chat_template"))
    if meta["add_space_prefix"] is None:
        meta.pop("add_space_prefix")
    if meta["add_bos"] is None:  # llama.cpp adds BOS to a SentencePiece vocabulary by default
        meta["add_bos"] = meta["model"] == "llama"
    for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                      ("unk", "unknown_token_id"), ("pad", "padding_token_id")):
        idx = g(key)
        ok = idx is not None and 0 <= int(idx) < len(tokens)
        meta[f"{name}_id"] = int(idx) if ok else None
        meta[f"{name}_token"] = tokens[int(idx)] if ok else None
    return meta


BUILDERS = {"gpt2": _gpt2, "llama": _spm}


def build_backend(meta: dict):
    """`tokenizers.Tokenizer` for the metadata (`metadata(reader)`)."""
    kind = meta.get("model")
    if kind not in BUILDERS:
        raise UnsupportedTokenizer(
            f"GGUF tokenizer model {kind!r} is not supported (supported: {sorted(BUILDERS)})")
    return BUILDERS[kind](meta)


def build_tokenizer(meta: dict):
    """`transformers.PreTrainedTokenizerFast` around `build_backend(meta)`."""
    from transformers import PreTrainedTokenizerFast

    kw = {f"{s}_token": meta[f"{s}_token"] for s in ("bos", "eos", "unk", "pad")
          if meta.get(f"{s}_token") is not None}
    if meta.get("chat_template"):
        kw["chat_template"] = meta["chat_template"]
    return PreTrainedTokenizerFast(
        tokenizer_object=build_backend(meta), clean_up_tokenization_spaces=False,
        add_bos_token=bool(meta.get("add_bos")), add_eos_token=bool(meta.get("add_eos")), **kw)


def tokenizer_from_gguf(reader):
    """The tokenizer a `gguf.GGUFReader`'s file describes, or None (with a warning saying
    why, when it has a vocabulary we cannot build)."""
    meta = metadata(reader)
    if meta is None:
        return None
    try:
        return build_tokenizer(meta)
    except UnsupportedTokenizer as e:
        warnings.warn(f"no tokenizer from the GGUF: {e}; pass prompts as token ids")
        return None
