"""Decay sweep for issue 16: the default vegas (d = 0.5) against other carry factors,
the paper's selector and stream; the variants are registered for this run only."""
import sys
from vegas_jax import selection as S
for d in (0.3, 0.7, 0.85):
    S.METHODS[f"vegas-d{d}"] = S.VerifyGuided("pair", decay=d)
from benchmarks import tau_study
sys.exit(tau_study.main(sys.argv[1:]))
