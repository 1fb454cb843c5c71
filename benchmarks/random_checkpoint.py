"""Write a random checkpoint with Llama-3.1-8B shapes (fewer layers if asked) for the multi-GPU timing scripts.

    python -m benchmarks.random_checkpoint --layers 8 --dtype bfloat16 --dir /tmp/tps8

tp_speed.py and tp_serving_throughput.py load such a folder in every process (one GPU, or every rank under
torchrun), so the single-GPU run and the tensor-parallel run time the same weights. Needs a GPU (the weights are
drawn there, as hf_rocketkv.bench.decode.build_model draws them for the other benchmarks).
"""

from __future__ import annotations

import argparse

import torch

from hf_rocketkv.bench.decode import LLAMA_31_8B, build_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (Llama-3.1-8B has 32)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--dir", required=True, help="folder to write (save_pretrained)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = build_model(LLAMA_31_8B, args.layers, getattr(torch, args.dtype), torch.device("cuda"), args.seed)
    model.save_pretrained(args.dir)
    print("saved", args.dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
