"""Benchmarks: attention time and memory per position scheme (``tools/bench_attention.py``, exported here);
training throughput (``train_bench``, tools/bench_train.py); the data pipeline (``data_bench``, tools/bench_data.py)."""

from megatron_lite.bench.attention_bench import BenchSettings, format_report, run_benchmark
from megatron_lite.bench.memory import PeakMemoryTracker, track_peak_memory

__all__ = ["BenchSettings", "PeakMemoryTracker", "format_report", "run_benchmark", "track_peak_memory"]
