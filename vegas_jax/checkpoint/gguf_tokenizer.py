"""A GGUF's tokenizer, rebuilt from its metadata through public, versioned APIs only.

A GGUF carries no `tokenizer.json`: llama.cpp's converter stores the vocabulary, merges,
token types, special ids and flags as metadata (`tokenizer.ggml.*`). We read those with the
`gguf` package's `GGUFReader` and assemble a `tokenizers.Tokenizer` from that library's public
models, normalizers, pre-tokenizers and decoders. `build_tokenizer` returns a `GGUFTokenizer`
around it: `encode`, `decode`, `batch_decode`, `apply_chat_template` (jinja2, rendered as
transformers renders it), the special tokens, `chat_template`, `vocab_size` and `len()` are its
own; anything else (`tok(texts, padding=True)`, `convert_ids_to_tokens`, `save_pretrained`,
...) goes to the `transformers.PreTrainedTokenizerFast(tokenizer_object=...)` it builds on
first use (`.hf`), and from then on everything does. Why: importing transformers takes seconds
where it imports torch, and loading a GGUF model should not pay that. transformers' own GGUF
integration is private, and its location and contents change between releases; nothing here
uses it.

`tokenizer.ggml.model`:
  "gpt2"  byte-level BPE (SmolLM2, Qwen3, Llama-3, gpt-oss). The split before BPE depends on
          `tokenizer.ggml.pre` (`PRE_TOKENIZERS`, the model's own tokenizer.json pattern);
          an unknown name falls back to GPT-2's split, with a warning.
  "llama" SentencePiece BPE (Llama-2, Mistral, TinyLlama): the file's merges, or merges
          derived from the token scores; metaspace (`tokenizer.ggml.add_space_prefix`) and
          byte fallback, as transformers' `LlamaTokenizerFast` builds it.
Anything else ("bert", "t5", "rwkv", ...) raises `UnsupportedTokenizer`; `tokenizer_from_gguf`
turns that into a warning and `None`: the model still loads, and prompts are token ids.

Import-light on purpose: numpy and `tokenizers`, plus `gguf`, `jinja2` and (for `.hf` only)
`transformers` inside the functions; nothing from jax or the rest of vegas_jax, so the file can
be loaded by path in a small environment (`tests/gguf_tokenizer_check.py` does, for CI's oldest
transformers).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import numbers
import warnings
from datetime import datetime
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


def build_tokenizer(meta: dict) -> GGUFTokenizer:
    """`GGUFTokenizer` around `build_backend(meta)` (imports no transformers)."""
    return GGUFTokenizer(build_backend(meta), meta)


def build_hf_tokenizer(meta: dict, backend=None):
    """`transformers.PreTrainedTokenizerFast` around `backend` (default `build_backend(meta)`),
    the tokenizer `GGUFTokenizer` stands for (its `.hf`)."""
    from transformers import PreTrainedTokenizerFast

    kw = {f"{s}_token": meta[f"{s}_token"] for s in ("bos", "eos", "unk", "pad")
          if meta.get(f"{s}_token") is not None}
    if meta.get("chat_template"):
        kw["chat_template"] = meta["chat_template"]
    return PreTrainedTokenizerFast(
        tokenizer_object=build_backend(meta) if backend is None else backend,
        clean_up_tokenization_spaces=False,
        add_bos_token=bool(meta.get("add_bos")), add_eos_token=bool(meta.get("add_eos")), **kw)


# apply_chat_template's options that only transformers handles (anything else it is passed is
# a template variable).
_HF_CHAT_OPTIONS = frozenset({
    "continue_final_message", "return_assistant_tokens_mask", "sanitize_control_tokens",
    "padding", "truncation", "max_length", "return_tensors", "tokenizer_kwargs"})
# Message keys that transformers releases rewrite before rendering (5.x copies a message's
# reasoning between these names) or drop (5.x: keys whose value is None).
_REASONING_KEYS = frozenset({"reasoning_content", "thinking", "reasoning"})
_SPECIAL_NAMES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")


def _plain(v) -> bool:
    """JSON-like data, which every transformers release hands a chat template unchanged."""
    if v is None or type(v) in (str, int, float, bool):
        return True
    if type(v) in (list, tuple):
        return all(map(_plain, v))
    if type(v) is dict:
        return all(type(k) is str and _plain(x) for k, x in v.items())
    return False


def _plain_chat(messages) -> bool:
    return (type(messages) in (list, tuple) and len(messages) > 0 and all(
        type(m) is dict and _plain(m)
        and all(v is not None and k not in _REASONING_KEYS for k, v in m.items())
        for m in messages))


def _id_list(ids) -> list[int] | None:
    """One sequence of token ids (an int, a list / tuple of ints or numpy ints, a 0- or 1-D
    array) as a list of ints; None for anything else (a batch, a dict, ...)."""
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):
        ids = ids.tolist()
    if isinstance(ids, numbers.Integral) and not isinstance(ids, bool):
        return [int(ids)]
    if isinstance(ids, (list, tuple)) and all(
            isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
        return [int(i) for i in ids]
    return None


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: no HTML escaping (jinja's own tojson escapes), json.dumps' options
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compiled_chat_template(template: str):
    """`template` compiled the way transformers compiles chat templates: an immutable sandbox,
    trim_blocks / lstrip_blocks, loop controls, `{% generation %}` blocks (rendered as their
    body), the `tojson` filter, `raise_exception`, `strftime_now`, and `dict` / `namespace`
    globals that refuse what transformers' refuse (no underscore names on a namespace)."""
    import jinja2
    import jinja2.exceptions
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox
    import jinja2.utils

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno)

        def _body(self, caller):
            return caller()

    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace: "
                f"{name!r}")

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # jinja's signature trick: namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=_strftime_now,
                       dict=Dict(), namespace=Namespace)
    return env.from_string(template)


def _special_property(name: str, as_id: bool):
    def get(self):
        hf = self.__dict__.get("_hf")
        if hf is not None:
            return getattr(hf, name)
        token = self._special[name.removesuffix("_id").removesuffix("_token")]
        if not as_id or token is None:
            return token
        return self._token_id(token)

    get.__name__ = name
    return property(get, doc=f"As `PreTrainedTokenizerFast.{name}`.")


def _special_properties(special: str) -> tuple[property, property]:
    """`{special}_token` and `{special}_token_id`, as PreTrainedTokenizerFast has them."""
    return (_special_property(f"{special}_token", False),
            _special_property(f"{special}_token_id", True))


class GGUFTokenizer:
    """A GGUF's tokenizer that stands for `build_hf_tokenizer(meta)` (a
    `transformers.PreTrainedTokenizerFast`) without importing transformers for what the engine
    uses: `encode`, `decode`, `batch_decode`, `apply_chat_template`, `bos_token` / `eos_token` /
    `unk_token` / `pad_token` (and `sep_`, `cls_`, `mask_`) with their `_id`s, `chat_template`,
    `vocab_size`, `len()`. Each gives what the PreTrainedTokenizerFast gives, for the inputs it
    handles itself (plain strings, id lists / arrays, JSON-like chat messages); other inputs or
    options, and any other attribute, go to that PreTrainedTokenizerFast (`.hf`), built on first
    use, after which every call goes to it (so that a change made to it, like
    `tok.pad_token = ...`, which is forwarded there, holds everywhere).

    `apply_chat_template(tokenize=True)` returns ids (`encode(text, add_special_tokens=False)`)
    when `return_dict=False` is passed; without it, the call goes to transformers, whose
    default differs between releases (4.x: ids, 5.x: a `BatchEncoding`)."""

    def __init__(self, backend, meta: dict):
        from tokenizers import AddedToken

        d = self.__dict__
        d["_backend"], d["_meta"], d["_hf"] = backend, meta, None
        d["_special"] = {s: meta.get(f"{s}_token") for s in _SPECIAL_NAMES}
        d["_chat_template"] = meta.get("chat_template") or None
        # What PreTrainedTokenizerFast's __init__ does to its backend that changes ids: a
        # special token the backend does not yet treat as an added token becomes a special one.
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = [t for t in dict.fromkeys(d["_special"].values()) if t and t not in added]
        if missing:
            backend.add_tokens([AddedToken(t, special=True) for t in missing])

    # one per _SPECIAL_NAMES entry
    bos_token, bos_token_id = _special_properties("bos")
    eos_token, eos_token_id = _special_properties("eos")
    unk_token, unk_token_id = _special_properties("unk")
    sep_token, sep_token_id = _special_properties("sep")
    pad_token, pad_token_id = _special_properties("pad")
    cls_token, cls_token_id = _special_properties("cls")
    mask_token, mask_token_id = _special_properties("mask")

    # -- the PreTrainedTokenizerFast, on demand -----------------------------------------------
    @property
    def hf(self):
        """The `transformers.PreTrainedTokenizerFast` this stands for (built on first use,
        importing transformers; every call goes to it from then on)."""
        if self._hf is None:
            self.__dict__["_hf"] = build_hf_tokenizer(self._meta, self._backend)  # copies it
        return self._hf

    @property
    def backend_tokenizer(self):
        """The `tokenizers.Tokenizer` (the PreTrainedTokenizerFast's own, once built)."""
        return self._backend if self._hf is None else self._hf.backend_tokenizer

    def __getattr__(self, name):
        # Only names not found the normal way come here; private and dunder ones (pickle and
        # copy probe __setstate__, __deepcopy__, ... before __dict__ is filled) are not ours.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hf, name)

    def __setattr__(self, name, value):
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.hf, name, value)

    def __call__(self, *args, **kwargs):
        return self.hf(*args, **kwargs)

    def __len__(self) -> int:
        if self._hf is not None:
            return len(self._hf)
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return (f"GGUFTokenizer(model={self._meta.get('model')!r}, "
                f"pre={self._meta.get('pre')!r}, vocab_size={self.vocab_size}, "
                f"hf={'built' if self._hf is not None else 'not built'})")

    @property
    def vocab_size(self) -> int:
        if self._hf is not None:
            return self._hf.vocab_size
        return self._backend.get_vocab_size(with_added_tokens=False)

    @property
    def chat_template(self):
        return self._chat_template if self._hf is None else self._hf.chat_template

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The special tokens that are set, by name (what a chat template sees)."""
        if self._hf is not None:
            return self._hf.special_tokens_map
        return {f"{s}_token": t for s, t in self._special.items() if t is not None}

    def _token_id(self, token: str):
        idx = self._backend.token_to_id(token)
        if idx is None and token != self._special["unk"] and self._special["unk"] is not None:
            return self._token_id(self._special["unk"])
        return idx

    # -- encode / decode ----------------------------------------------------------------------
    def encode(self, text, text_pair=None, add_special_tokens: bool = True, **kwargs):
        """Token ids of `text`, BOS / EOS added as the file says (`add_special_tokens`)."""
        if self._hf is not None or text_pair is not None or kwargs or type(text) is not str:
            return self.hf.encode(text, text_pair=text_pair,
                                  add_special_tokens=add_special_tokens, **kwargs)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs):
        """The text of one sequence of ids (a list, a numpy array, numpy ints, an int)."""
        ids = None if self._hf is not None or kwargs else _id_list(token_ids)
        if ids is None:
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False, **kwargs):
        """`decode` of each sequence."""
        if hasattr(sequences, "tolist") and not isinstance(sequences, (list, tuple)):
            sequences = sequences.tolist()
        batch = None  # a non-empty list of sequences (releases differ on anything else)
        if self._hf is None and not kwargs and isinstance(sequences, (list, tuple)) and sequences:
            batch = [None if isinstance(s, numbers.Integral) else _id_list(s) for s in sequences]
        if batch is None or any(s is None for s in batch):
            return self.hf.batch_decode(sequences, skip_special_tokens=skip_special_tokens,
                                        **kwargs)
        return self._backend.decode_batch(batch, skip_special_tokens=skip_special_tokens)

    # -- chat ---------------------------------------------------------------------------------
    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template=None,
                            add_generation_prompt: bool = False, *, tokenize: bool = True,
                            return_dict=None, **kwargs):
        """The conversation rendered with the chat template (`tokenize=False`), or its ids
        (`tokenize=True, return_dict=False`), as `PreTrainedTokenizerFast.apply_chat_template`
        gives them; extra keyword arguments are template variables (`enable_thinking=...`).
        Batches, message objects, callable tools, non-JSON values, messages with None values
        or reasoning fields, transformers-only options (`continue_final_message`, `padding`,
        `return_tensors`, ...) and `tokenize=True` without `return_dict=False` go to `.hf`."""
        template = self.chat_template if chat_template is None else chat_template
        fast = (self._hf is None and isinstance(template, str)
                and (return_dict is False or (not tokenize and return_dict is None))
                and not _HF_CHAT_OPTIONS.intersection(kwargs) and _plain(kwargs)
                and _plain_chat(conversation)
                and (tools is None or (type(tools) in (list, tuple)
                                       and all(type(t) is dict for t in tools) and _plain(tools)))
                and (documents is None or (type(documents) in (list, tuple)
                                           and all(type(d) is dict for d in documents)
                                           and _plain(documents))))
        if not fast:
            if return_dict is not None:
                kwargs["return_dict"] = return_dict
            return self.hf.apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs)
        text = _compiled_chat_template(template).render(
            messages=conversation, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **kwargs})
        if not tokenize:
            return text
        return self._backend.encode(text, add_special_tokens=False).ids


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
