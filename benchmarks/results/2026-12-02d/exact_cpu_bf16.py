import json, time
from vegas_jax import load_model, generate, speculative_generate, SpecConfig
def fd(x, y): return next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
P = [p[-600:] for p in json.load(open('.gpu_a/prompts.json'))['prompts'][:8]]
m = load_model(dtype="bfloat16")
t = time.time()
ref = generate(m, P, 32).tokens
print("vanilla", time.time() - t, flush=True)
for exact in (False, True):
    t = time.time()
    out = speculative_generate(m, P, 32, SpecConfig(method="vegas", gamma=6, min_tokens=16, exact=exact)).tokens
    print("exact" if exact else "plain", [fd(a, b) for a, b in zip(ref, out)], time.time() - t, flush=True)
