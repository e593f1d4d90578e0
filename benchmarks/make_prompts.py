"""Token-id prompts for GPU runs: real documents through the chat template, tokenized
here (the GPU image's transformers cannot read the GGUF's tokenizer).

    python -m benchmarks.make_prompts --out .gpu_a/prompts.json [--tokens 7560] [--per-kind 4]

Per kind (CPython's language reference prose, standard-library code; `vegas_jax.workloads`)
`--per-kind` documents of `--tokens` tokens that do not overlap (offsets 1000 + i * tokens),
each with the kind's task, through SmolLM2's chat template: ~7.6K tokens each by default."""

from __future__ import annotations

import argparse
import json


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write ({prompts, meta})")
    p.add_argument("--tokens", type=int, default=7560, help="document length in tokens")
    p.add_argument("--per-kind", type=int, default=4, help="documents per kind")
    args = p.parse_args(argv)

    import jax.numpy as jnp

    from vegas_jax.loading import load_model
    from vegas_jax.workloads import TASKS, source_text

    tok = load_model(dtype=jnp.float32).tokenizer
    prompts, meta = [], []
    for kind in ("prose", "code"):
        ids = tok.encode(source_text(kind))
        for i in range(args.per_kind):
            off = 1000 + i * args.tokens
            if off + args.tokens > len(ids):
                raise ValueError(f"only {len(ids)} tokens of {kind} text")
            doc = tok.decode(ids[off:off + args.tokens])
            msg = [{"role": "user", "content": f"{doc}\n\n{TASKS[kind]}"}]
            text = tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
            prompts.append(tok.encode(text))
            meta.append((kind, off, len(prompts[-1])))
    with open(args.out, "w") as f:
        json.dump({"prompts": prompts, "meta": meta}, f)
    print(meta)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
