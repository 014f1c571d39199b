"""Benchmark tasks: task files read into items (items.py), continuations scored as lm-evaluation-harness scores
them, through the KV cache (score.py), the references' measures with bootstrap intervals (measure.py), and the
table and the JSON results (report.py)."""
