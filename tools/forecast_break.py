#!/usr/bin/env python
"""When does a model's extrapolation break? Fits the in-training curve's climb past the training length and
projects it to a threshold ratio ppl(kx) / ppl(1x) (2 by default).

    python tools/forecast_break.py runs/rope runs/coca_slack          # run directories (metrics.jsonl)
    python tools/forecast_break.py OUT/results.json --threshold 1.5   # a reproduction's models

Needs runs trained with ``train.extrapolation_eval`` on. Per model and window: the last ratio, a power law
fitted to ratio - 1 against tokens seen (exponent, R^2 in log-log space), and the tokens at which the ratio
crossed the threshold or, continued, would. A projection is an extrapolation of a noisy curve, not a
measurement: docs/training.md#forecasting-the-break says how to read it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from megatron_lite.cli import cli_main, run_cli
from megatron_lite.eval.report import markdown_table
from megatron_lite.repro.break_forecast import (DEFAULT_FIT_FROM_FRACTION, DEFAULT_THRESHOLD, WindowForecast,
                                                forecast, forecast_header, forecast_table_rows, load_curves)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path,
                        help="run directories or their metrics.jsonl, or a reproduction's results.json / OUT dir")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                        help="the ratio ppl(kx) / ppl(1x) to forecast (2: perplexity doubles past the training length)")
    parser.add_argument("--fit-from-fraction", type=float, default=DEFAULT_FIT_FROM_FRACTION,
                        help="leave evaluations in this first fraction of each run's tokens out of the fit (warm-up)")
    parser.add_argument("--json", action="store_true", help="print the forecasts as JSON instead of tables")
    return parser.parse_args(argv)


@cli_main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reports: dict[str, list[WindowForecast]] = {}
    for path in args.runs:
        for name, rows in load_curves(path).items():
            label = name if len(args.runs) == 1 else f"{path}: {name}"
            reports[label] = forecast(rows, args.threshold, args.fit_from_fraction)
    if args.json:
        print(json.dumps({label: [asdict(item) for item in items] for label, items in reports.items()}, indent=1))
        return 0
    for label, items in reports.items():
        print(f"## {label}\n")
        print((markdown_table(forecast_header(args.threshold), forecast_table_rows(items)) + "\n") if items
              else "no window past 1x in its evaluations\n")
    return 0


if __name__ == "__main__":
    run_cli(main)
