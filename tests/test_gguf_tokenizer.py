"""The GGUF tokenizer (`vegas_jax.checkpoint.gguf_tokenizer`): SmolLM2's, id for id against a
reference (cases and ids in `tests/gguf_tokenizer_check.py`, which CI also runs with the
oldest transformers the project allows), plus the builders on tiny made-up vocabularies."""

from __future__ import annotations

import subprocess
import sys
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
