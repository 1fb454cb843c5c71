"""One-command decode benchmark: DynamicCache vs StaticCache+compile vs RocketKVCache (Llama-3.1-8B shape, random weights).

    python benchmarks/bench_decode.py                 # full grid on the GPU (batch 1/4/16 x context 8k/32k/100k)
    python benchmarks/bench_decode.py --quick         # CPU smoke run
    python benchmarks/bench_decode.py --layers 8 --batch 1 --context 8192

All options: ``python benchmarks/bench_decode.py --help`` (implementation: hf_rocketkv/bench/decode.py).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_rocketkv.bench.decode import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
