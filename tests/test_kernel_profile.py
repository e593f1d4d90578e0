"""pallas_kernels/kernel_profile.py on the CPU: it runs end to end and writes the HLO (the
kernel table itself needs a GPU trace; on the CPU it is empty)."""

from pallas_kernels import kernel_profile


def test_runs_and_writes_hlo(tmp_path, capsys):
    rc = kernel_profile.main(["--model", "smollm2-135m", "--batch", "1", "--context", "200",
                              "--gamma", "2", "--attn-impl", "xla", "--hlo", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "decode step:" in out and "vegas round wall:" in out
    for name in ("decode.hlo.txt", "round.hlo.txt"):
        assert "HloModule" in (tmp_path / name).read_text()[:200]
