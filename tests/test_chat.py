"""Prompts as chat conversations: one rule for the API and the command line. A
conversation (a list of {"role", "content"} messages) goes through the model's chat
template with the generation prompt; a string is its tokens as they are; token ids are
taken as given. `python -m vegas_jax.decode` sends each --prompt as a one-message user
conversation (as it is with --raw)."""

import json

import pytest

from tests.tiny import tiny_model, tiny_tokenizer, with_tokenizer
from vegas_jax import decode, generate, speculative_generate, SpecConfig
from vegas_jax.execution import ExecConfig
from vegas_jax.prompts import encode_prompts

# Words of tests.tiny's tokenizer only; the generation prompt is "hello".
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }} </s> {% endfor %}"
            "{% if add_generation_prompt %}hello{% endif %}")
CONV = [{"role": "user", "content": "the cat sat"}]


def chat_tokenizer():
    tok = tiny_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(autouse=True)
def _keep_jax_cache_config(jax_cache_config_restored):
    """`decode.main` turns on the compilation cache: this process's setting comes back."""


@pytest.fixture(scope="module")
def model():
    m = tiny_model(vocab=100)
    return m._replace(tokenizer=chat_tokenizer(), exec_config=ExecConfig(backend="xla"))


def template_ids(tok, conv):
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def test_conversation_gets_the_chat_template_strings_stay_raw(model):
    tok = model.tokenizer
    conv = [{"role": "system", "content": "a mat"}, *CONV]
    ids = encode_prompts(model, [conv, "the cat sat", [5, 6, 7]])
    # <s> a mat </s> the cat sat </s> hello: the template, its generation prompt at the end
    assert ids[0] == template_ids(tok, conv) == [1, 9, 10, 2, 5, 6, 7, 2, 3]
    assert ids[1] == tok.encode("the cat sat") == [5, 6, 7]
    assert ids[2] == [5, 6, 7]


def test_generate_and_speculative_generate_take_conversations(model):
    ids = template_ids(model.tokenizer, CONV)
    ref = generate(model, [ids], max_new_tokens=6)
    assert generate(model, [CONV], max_new_tokens=6).tokens == ref.tokens
    out = speculative_generate(model, [CONV, ids], 6, spec=SpecConfig(method="vegas", gamma=2))
    assert out.tokens == ref.tokens * 2


@pytest.mark.parametrize("prompts, error, message", [
    (CONV, TypeError, "prompts must be a list of prompts"),  # one conversation, unwrapped
    ([[{"role": "user"}]], ValueError, "prompt 0: each message needs a string 'role' and "
                                       "'content'"),
    ([[{"role": "user", "content": 3}]], ValueError, "'content'"),
])
def test_bad_conversations_are_clear_errors(model, prompts, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(")):
        encode_prompts(model, prompts)


def test_conversation_needs_a_chat_template(model):
    plain = model._replace(tokenizer=tiny_tokenizer())
    with pytest.raises(ValueError, match="prompt 1 is a conversation, but this model's "
                                         "tokenizer has no chat template"):
        encode_prompts(plain, ["the cat", CONV])
    with pytest.raises(ValueError, match="no tokenizer"):
        encode_prompts(model._replace(tokenizer=None), [CONV])


@pytest.fixture(scope="module")
def chat_ckpt(tiny_hf, tmp_path_factory):
    """A tiny Qwen3 checkpoint whose tokenizer has `TEMPLATE` as its chat template."""
    src, _ = tiny_hf("qwen3-untied")
    dst = with_tokenizer(src, tmp_path_factory.mktemp("chat") / "tiny-chat")
    chat_tokenizer().save_pretrained(str(dst))
    return str(dst)


@pytest.mark.parametrize("raw", [False, True])
def test_cli_sends_each_prompt_as_a_user_message(chat_ckpt, raw, capsys):
    """The command line's --prompt is the API's one-message user conversation (--raw: the
    API's string): the same tokens; --json's prompt is the text as typed."""
    from vegas_jax.loading import load_model

    text = "the cat sat"
    flags = ["--checkpoint", chat_ckpt, "--prompt", text, "--max-new-tokens", "5", "--json",
             "--method", "vegas", "--gamma", "2", "--backend", "xla"] + ["--raw"] * raw
    assert decode.main(flags) == 0
    out = json.loads(capsys.readouterr().out)
    (res,) = out["results"]
    assert res["prompt"] == text
    # <s> the cat sat </s> hello, or the cat sat
    assert out["stats"]["prompt_tokens"] == [3 if raw else 6]
    model = load_model(checkpoint=chat_ckpt, exec_config=ExecConfig(backend="xla"))
    api = speculative_generate(model, [text if raw else CONV], 5,
                               spec=SpecConfig(method="vegas", gamma=2))
    assert res["tokens"] == api.tokens[0]
