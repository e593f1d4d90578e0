"""Real text available offline on every machine with CPython: workloads for tests,
benchmarks and the tuner (no generated filler).

- prose: the Python language reference topics shipped with CPython
  (`pydoc_data/topics.py`), real English technical documentation.
- code: CPython's own standard-library sources.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

CODE_MODULES = ("argparse", "dataclasses", "inspect", "typing", "pathlib", "json.decoder")


def _prose() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def _code() -> str:
    parts = []
    for name in CODE_MODULES:
        spec = importlib.util.find_spec(name)
        parts.append(Path(spec.origin).read_text())
    return "\n\n".join(parts)


def source_text(kind: str) -> str:
    if kind == "prose":
        return _prose()
    if kind == "code":
        return _code()
    raise ValueError(f"unknown text kind {kind!r}; choose prose or code")


def document(tokenizer, n_tokens: int, kind: str = "prose", offset: int = 0) -> str:
    """About `n_tokens` tokens of real text, starting `offset` tokens into the source."""
    ids = tokenizer.encode(source_text(kind))
    if offset + n_tokens > len(ids):
        raise ValueError(f"only {len(ids)} tokens of {kind} text available")
    return tokenizer.decode(ids[offset: offset + n_tokens])


TASKS = {
    "prose": "Summarize the documentation above, section by section, in detail.",
    "code": "Explain what the code above does, function by function.",
}


def long_prompts(tokenizer, lengths, kind: str = "prose", chat: bool = True) -> list[str]:
    """Prompts of about the given token lengths: a real document and a task about it,
    through the chat template when the tokenizer has one."""
    out = []
    for i, n in enumerate(lengths):
        doc = document(tokenizer, n, kind, offset=i * 997)
        if chat and getattr(tokenizer, "chat_template", None):
            msg = [{"role": "user", "content": f"{doc}\n\n{TASKS[kind]}"}]
            out.append(tokenizer.apply_chat_template(msg, tokenize=False,
                                                     add_generation_prompt=True))
        else:
            out.append(doc)
    return out
