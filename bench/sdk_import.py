"""What `import agl` costs a harness process, against references measured in the same run.

Prints the median wall time of a fresh interpreter that imports agl, next to a bare interpreter
and to one importing what an eager SDK would (the OpenTelemetry SDK with its OTLP/HTTP exporter),
and the time of a first emit_reward (which loads that pipeline lazily).

    python bench/sdk_import.py [--runs 15] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

CASES = {
    "bare python": "pass",
    "import agl": "import agl",
    "eager OTel SDK + OTLP exporter": (
        "import opentelemetry.sdk.trace, opentelemetry.exporter.otlp.proto.http.trace_exporter"
    ),
}
# In-process cost of the first reward (it builds the export pipeline); the child exits without
# waiting for delivery, since nothing listens.
FIRST_REWARD = (
    "import os, time; os.environ['AGL_OTLP_ENDPOINT']='http://127.0.0.1:9'; import agl; "
    "t = time.perf_counter(); agl.emit_reward(1.0, rollout_id='r'); "
    "print(time.perf_counter() - t, flush=True); os._exit(0)"
)


def time_once(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="5 runs per case")
    args = parser.parse_args()
    runs = 5 if args.quick else args.runs
    samples: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(runs):  # interleaved, so machine noise hits every case alike
        for name, code in CASES.items():
            samples[name].append(time_once(code))
    first_reward = [
        float(subprocess.run([sys.executable, "-c", FIRST_REWARD], check=True, capture_output=True, text=True).stdout)
        for _ in range(runs)
    ]
    median = {name: statistics.median(values) * 1000 for name, values in samples.items()}
    bare = median["bare python"]
    print(f"{'case':36} {'median ms':>10} {'added ms':>10}")
    for name, value in median.items():
        print(f"{name:36} {value:10.1f} {value - bare:10.1f}")
    added_agl = median["import agl"] - bare
    added_eager = median["eager OTel SDK + OTLP exporter"] - bare
    print(f"{'first emit_reward (in process)':36} {statistics.median(first_reward) * 1000:10.1f}")
    print(f"\nimport agl adds {added_agl:.1f} ms (target < 150 ms); "
          f"ratio vs an eager OTel SDK import: {added_agl / added_eager:.2f}x")


if __name__ == "__main__":
    main()
