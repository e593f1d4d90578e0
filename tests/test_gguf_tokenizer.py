"""The GGUF tokenizer (`vegas_jax.checkpoint.gguf_tokenizer`): SmolLM2's, id for id against a
reference (cases and ids in `tests/gguf_tokenizer_check.py`, which CI also runs with the
oldest transformers the project allows), plus the builders on tiny made-up vocabularies; and
`GGUFTokenizer` against the `PreTrainedTokenizerFast` it stands for, without importing
transformers for what the engine uses."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import textwrap
import types
import warnings
from pathlib import Path

import pytest

from tests import gguf_tokenizer_check as ref
from vegas_jax.checkpoint import gguf_tokenizer as gt

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reader(smollm2_gguf):
    from vegas_jax.checkpoint.gguf import open_gguf

    return open_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def tok(reader):
    from vegas_jax.checkpoint.gguf import read_tokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a known pre-tokenizer: no fallback warning
        return read_tokenizer(reader)


@pytest.mark.parametrize("i", range(len(ref.SMOLLM2_TEXTS)))
def test_smollm2_ids(tok, i):
    text, want = ref.SMOLLM2_TEXTS[i], ref.SMOLLM2_IDS[i]
    assert list(tok.encode(text)) == want, tok.convert_ids_to_tokens(tok.encode(text))
    assert tok.decode(want) == text  # round trip


def test_smollm2_everything_else(tok):
    """Special tokens one id each, names, size, chat template, digit split (`smollm_problems`)."""
    assert ref.smollm2_problems(tok) == []


def test_builders_on_made_up_vocabularies():
    """SentencePiece BPE (merges from scores, metaspace, byte fallback, BOS) and the
    Llama-3 / Qwen2 / SmolLM split patterns."""
    assert ref.synthetic_problems(gt) == []


def test_unknown_pre_tokenizer_falls_back_with_a_warning():
    vocab = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["\u0120", "ab", "\u0120c"]
    meta = dict(model="gpt2", pre="no-such-pre", tokens=vocab, merges=["a b", "\u0120 c"],
                add_bos=False)
    with pytest.warns(UserWarning, match="no-such-pre"):
        tok = gt.build_tokenizer(meta)
    assert tok.convert_ids_to_tokens(tok.encode("ab c")) == ["ab", "\u0120c"]


def test_unsupported_model_gives_none_and_says_why(reader):
    fields = dict(reader.fields)
    model = fields["tokenizer.ggml.model"]
    fake = types.SimpleNamespace(fields={
        **fields, "tokenizer.ggml.model": types.SimpleNamespace(contents=lambda: "bert")})
    assert model.contents() == "gpt2"
    with pytest.warns(UserWarning, match="'bert' is not supported"):
        assert gt.tokenizer_from_gguf(fake) is None
    with pytest.raises(gt.UnsupportedTokenizer, match="bert"):
        gt.build_backend(dict(model="bert", tokens=["a"]))
    assert gt.tokenizer_from_gguf(types.SimpleNamespace(fields={})) is None  # no vocabulary


def test_field_without_contents_matches_contents(tmp_path):
    """gguf < 0.16 has no `ReaderField.contents()`: `field` decodes parts / data itself."""
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "\u0120a", "\u4f60\u597d"])
    w.add_token_types([3, 1, 1])
    w.add_bos_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template("{{ messages[0]['content'] }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    reader = gguf.GGUFReader(str(tmp_path / "t.gguf"))
    keys = [k for k in reader.fields if k.startswith("tokenizer.")]
    assert len(keys) == 6
    for key in keys:
        f = reader.fields[key]
        old = types.SimpleNamespace(parts=f.parts, data=f.data, types=f.types)
        assert gt.field(types.SimpleNamespace(fields={key: old}), key) == f.contents(), key


@pytest.mark.slow
def test_reference_ids_are_transformers_gguf_tokenizer(smollm2_gguf):
    """The reference is transformers' own `AutoTokenizer.from_pretrained(gguf_file=)` (5.25),
    except the last case, where it ignores the file's "smollm" digit split (see
    gguf_tokenizer_check.py)."""
    from transformers import AutoTokenizer

    path = Path(smollm2_gguf)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text, want in zip(ref.SMOLLM2_TEXTS[:-1], ref.SMOLLM2_IDS[:-1], strict=True):
        assert theirs.encode(text) == want, text
    assert theirs.apply_chat_template(ref.SMOLLM2_CHAT, tokenize=False,
                                      add_generation_prompt=True) == ref.SMOLLM2_CHAT_TEXT
    assert theirs.encode(ref.SMOLLM2_CHAT_TEXT) == ref.SMOLLM2_CHAT_IDS


@pytest.mark.slow
def test_check_script_runs_without_jax(smollm2_gguf):
    """What CI runs in the oldest-transformers venv, here: the module loaded by path, no jax."""
    r = subprocess.run([sys.executable, "tests/gguf_tokenizer_check.py", str(smollm2_gguf)],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all cases match" in r.stdout


def test_same_as_pretrained_tokenizer_fast_smollm2(reader):
    """encode / decode / batch_decode / apply_chat_template / special tokens of the
    GGUFTokenizer are the PreTrainedTokenizerFast's, without building it."""
    texts = [*ref.SMOLLM2_TEXTS, ref.SMOLLM2_CHAT_TEXT]
    assert ref.same_as_hf_problems(lambda: gt.tokenizer_from_gguf(reader), texts) == []


def test_same_as_pretrained_tokenizer_fast_made_up_vocabularies():
    assert ref.synthetic_same_as_hf_problems(gt) == []


def test_delegates_the_rest_to_pretrained_tokenizer_fast(reader):
    from transformers import PreTrainedTokenizerFast

    tok = gt.tokenizer_from_gguf(reader)
    assert isinstance(tok, gt.GGUFTokenizer) and tok._hf is None
    ids = tok(["a", "b"])["input_ids"]
    assert isinstance(tok.hf, PreTrainedTokenizerFast)
    assert ids == tok.hf(["a", "b"])["input_ids"] == [tok.encode("a"), tok.encode("b")]
    assert tok.convert_ids_to_tokens(tok.encode("Hello world")) == ["Hello", "\u0120world"]
    assert tok.backend_tokenizer is tok.hf.backend_tokenizer
    # From now on everything goes to it, so that what is set there holds everywhere.
    tok.pad_token = "<|endoftext|>"
    assert tok.hf.pad_token == tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    assert tok(["a", "b c"], padding=True)["input_ids"][0] == [*tok.encode("a"), 0]
    tok.chat_template = "{{ messages[0]['content'] }}!"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "x!"
    with pytest.raises(AttributeError):
        tok._no_such_private_name  # noqa: B018


def test_pickles_and_copies_without_building_transformers(reader):
    tok = gt.tokenizer_from_gguf(reader)
    for other in (pickle.loads(pickle.dumps(tok)), copy.copy(tok), copy.deepcopy(tok)):
        assert other._hf is None
        assert other.encode("Hello world") == [19556, 905]
        assert other.apply_chat_template(ref.SMOLLM2_CHAT, tokenize=False,
                                         add_generation_prompt=True) == ref.SMOLLM2_CHAT_TEXT
    assert tok._hf is None


def test_numpy_ids_decode():
    np = pytest.importorskip("numpy")
    tok = gt.build_tokenizer(ref.synthetic_metas()["spm"])
    ids = tok.encode("hello world")
    assert tok.decode(np.array(ids)) == tok.decode([np.int32(i) for i in ids]) == tok.decode(ids)
    assert tok.batch_decode(np.array([ids, ids])) == [tok.decode(ids)] * 2
    assert tok._hf is None


def test_engine_path_imports_no_transformers():
    """load_model() on the default GGUF, then what the engine asks of its tokenizer, in a fresh
    interpreter: transformers (and torch) stay unimported."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        from tests import gguf_tokenizer_check as ref
        from vegas_jax import load_model
        from vegas_jax.checkpoint import gguf_tokenizer as gt

        from vegas_jax.prompts import encode_prompts

        model = load_model()
        tok = model.tokenizer
        assert isinstance(tok, gt.GGUFTokenizer), type(tok)
        assert encode_prompts(model, [ref.SMOLLM2_CHAT]) == [ref.SMOLLM2_CHAT_IDS]
        assert tok.encode(ref.SMOLLM2_TEXTS[1]) == ref.SMOLLM2_IDS[1]
        assert tok.decode(np.array(ref.SMOLLM2_IDS[1])) == ref.SMOLLM2_TEXTS[1]
        assert tok.batch_decode([ref.SMOLLM2_IDS[0]], skip_special_tokens=True) == ["Hello world"]
        assert tok.apply_chat_template(ref.SMOLLM2_CHAT, tokenize=False,
                                       add_generation_prompt=True) == ref.SMOLLM2_CHAT_TEXT
        assert tok.apply_chat_template(ref.SMOLLM2_CHAT, add_generation_prompt=True,
                                       return_dict=False) == ref.SMOLLM2_CHAT_IDS
        assert tok.apply_chat_template(ref.SMOLLM2_CHAT, chat_template=ref.TEST_TEMPLATE,
                                       tokenize=False, enable_thinking=True)
        assert (tok.eos_token_id, tok.bos_token, tok.chat_template is not None) == (
            2, "<|im_start|>", True)
        spm = gt.build_tokenizer(ref.synthetic_metas()["spm"])
        assert spm.decode(spm.encode("hello world"), skip_special_tokens=True) == "hello world"
        assert len(spm) == spm.vocab_size
        leaked = sorted(m for m in ("transformers", "torch") if m in sys.modules)
        assert not leaked, leaked
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
