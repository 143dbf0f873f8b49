"""Measurement: speed (llama_bench, speedup, bench_report, the `bench` command), the roofline
prediction (roofline), the HF PyTorch comparison (hf_compare), quality (perplexity, tasks,
torch_ppl, the `eval` command) and the m x quant sweep (sweep, sweep_report). Top of the stack
below the CLI."""
