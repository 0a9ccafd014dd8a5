"""bench/bench_sampler.py's dry run on the CPU: every case timed on the torch path, the kernel's
column saying why it did not run, the report written."""
import json

import torch

from bench import bench_sampler


def test_the_dry_run_times_every_case_and_says_why_the_kernel_did_not_run(tmp_path):
    out = tmp_path / "sampler.json"
    args = ["--device", "cpu", "--rows", "1,5", "--vocab", "300,1000", "--reps", "2"]
    report = bench_sampler.main([*args, "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["machine"]["device"] == "cpu" and report["machine"]["torch"] == torch.__version__
    cases = report["cases"]
    mixes = list(bench_sampler.MIXES)
    assert [(c["vocab"], c["rows"], c["mix"]) for c in cases] == [
        (vocab, rows, mix) for vocab in (300, 1000) for rows in (1, 5) for mix in mixes]
    assert all(c["torch_ms"] > 0 and c["triton_ms"] is None for c in cases)
    assert {c["triton_unavailable"] for c in cases} == {"torch (device cpu)"}


def test_the_logits_peak_so_that_top_p_keeps_a_few_tokens():
    from model_service.step.sampler import filtered_probs

    logits = bench_sampler.logits_for(3, 1000, torch.device("cpu"))
    params = bench_sampler.batch_for(3, bench_sampler.MIXES["top_p"])
    kept = (filtered_probs(logits, params) > 0).sum(dim=1)
    assert ((kept >= 2) & (kept <= 8)).all(), kept  # the 8 peaks hold most of the mass
    assert len(set(params.position.tolist())) == 3  # each row draws at its own position
