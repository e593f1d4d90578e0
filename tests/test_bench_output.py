"""What `python -m vegas_jax.bench` prints for its reader: one default per flag in --help,
the table's legend (the `= vanilla` column, the `tail` lines), a capture+select time that
is never negative, and errors that name the flag."""

import pytest

from tests.tiny import tiny_model
from vegas_jax import bench
from vegas_jax.speculative import SpecConfig


def test_help_explains_the_table_and_names_one_default_per_flag():
    text = " ".join(bench.build_parser().format_help().split())
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default smollm2-135m):" in text and "(default: 4096)" in text
    for term in ("= vanilla:", "capture+select ms:", "tail METHOD gGAMMA sSPARSITY:"):
        assert term in text


TIMES = {"verify_ms": 10.0, "verify_capture_ms": 11.5, "select_ms": 0.5}


@pytest.mark.parametrize("method, times, want", [
    ("vegas", TIMES, 2.0),  # capture 1.5 + select 0.5
    ("vegas", dict(TIMES, verify_capture_ms=9.0), None),  # capture below the noise: n/a
    ("stream", dict(TIMES, verify_capture_ms=9.0), 0.5),  # captures nothing: select alone
    ("quest", TIMES, 0.5),
])
def test_selection_overhead_is_never_negative(method, times, want):
    got = bench.selection_overhead(times, SpecConfig(method=method))
    assert got == (pytest.approx(want) if want is not None else None)


def test_table_shows_n_a_not_a_negative_time():
    rows = [{"method": "vanilla", "gamma": 0, "tok_s": 10.0},
            {"method": "vegas", "gamma": 6, "sparsity": 0.07, "equal_sequences": 4,
             **dict(TIMES, verify_capture_ms=9.0), "selection_overhead_ms": None}]
    table = bench.format_table(rows, 6)
    head, _, _, vegas = table.splitlines()
    cells = [c.strip() for c in vegas.split("|")[1:-1]]
    names = [c.strip() for c in head.split("|")[1:-1]]
    assert cells[names.index("capture+select ms")] == "n/a"
    assert cells[names.index("= vanilla")] == "4"
    assert not any(c.startswith("-") for c in cells)


@pytest.mark.slow
def test_legend_printed_under_the_table(capsys):
    from tests.tiny import BENCH_WORKLOAD

    assert bench.main(["--profile-only", *BENCH_WORKLOAD, "--gamma", "2", "--methods", "vegas",
                       "--profile-reps", "1"], model=tiny_model(scale=0.3)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("# ") and out[1].startswith("| method |")
    assert out[-len(bench.LEGEND):] == [f"# {line}" for line in bench.LEGEND]


def test_errors_name_the_flags(capsys):
    for flags, msg in [(["--top-p", "2"], "error: --top-p must be in (0, 1]"),
                       (["--sparsities", "0.07,0"], "error: --sparsities: each sparsity must")]:
        assert bench.main(flags, model=tiny_model()) == 2
        assert capsys.readouterr().err.startswith(msg)
