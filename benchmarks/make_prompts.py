"""Token-id prompts for GPU runs: real documents through the chat template, tokenized
here (the GPU image's transformers cannot read the GGUF's tokenizer).

    python -m benchmarks.make_prompts --out .gpu_a/prompts.json [--tokens 7560] [--per-kind 4]
    python -m benchmarks.make_prompts --out .gpu_a/prompts.json \
        --files /usr/share/common-licenses/GPL-3 ... --files-code /usr/include/stdlib.h ...

Per kind (prose, code) `--per-kind` documents of `--tokens` tokens that do not overlap
(offsets 1000 + i * tokens), each with the kind's task, through SmolLM2's chat template:
~7.6K tokens each by default. The text is CPython's language reference and standard
library (`vegas_jax.workloads`), or the given files, concatenated (text not in the repo)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write ({prompts, meta})")
    p.add_argument("--tokens", type=int, default=7560, help="document length in tokens")
    p.add_argument("--per-kind", type=int, default=4, help="documents per kind")
    p.add_argument("--files", nargs="*", default=None, help="prose files (instead of CPython's)")
    p.add_argument("--files-code", nargs="*", default=None, help="code files (instead of CPython's)")
    args = p.parse_args(argv)

    import jax.numpy as jnp

    from vegas_jax.loading import load_model
    from vegas_jax.workloads import TASKS, source_text

    tok = load_model(dtype=jnp.float32).tokenizer
    given = {"prose": args.files, "code": args.files_code}
    prompts, meta = [], []
    for kind in ("prose", "code"):
        files = given[kind]
        text = ("\n\n".join(Path(f).read_text(errors="replace") for f in files) if files
                else source_text(kind))
        ids = tok.encode(text)
        for i in range(args.per_kind):
            off = 1000 + i * args.tokens
            if off + args.tokens > len(ids):
                raise ValueError(f"only {len(ids)} tokens of {kind} text")
            doc = tok.decode(ids[off:off + args.tokens])
            msg = [{"role": "user", "content": f"{doc}\n\n{TASKS[kind]}"}]
            text_i = tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
            prompts.append(tok.encode(text_i))
            meta.append((kind, off, len(prompts[-1])))
    with open(args.out, "w") as f:
        json.dump({"prompts": prompts, "meta": meta}, f)
    print(meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
