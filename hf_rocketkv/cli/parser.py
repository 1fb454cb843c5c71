"""The argument parser of ``hf-rocketkv``: every flag, its help, and range checks that fail at parse time.

argparse prints the whole usage block before an error; this parser prints two lines instead (the error, then where
to read the options), so every mistake on the command line reads like every other CLI error. The parser class and the
range-checked argument types live in ``argparse_helpers.py``, below both the CLI and the benchmarks that share them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..argparse_helpers import ShortErrorParser, fraction, int_at_least
from ..models import DEFAULT_MODEL

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_PREFILL_CHUNK = 512


def bundled_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"'{DEFAULT_MODEL}' (the embedded SmolLM2-135M-Instruct, default), a local checkpoint folder or a "
        ".gguf file",
    )
    common.add_argument(
        "--config", default=None, help=f"YAML config file, or a bundled one by name: {', '.join(bundled_configs())}"
    )
    common.add_argument("--device", default=None, help="torch device, e.g. cuda (default: cpu)")
    common.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV dtype; auto keeps the checkpoint's (float32 for the GGUF default)",
    )
    common.add_argument(
        "--threads",
        type=int_at_least(1),
        default=None,
        help="torch CPU threads (default: the physical cores this process may use, fewer when the machine is busy; "
        "OMP_NUM_THREADS is respected)",
    )
    common.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a sparse_attention_config field, repeatable: --set prompt_budget=512 --set topk=32",
    )
    common.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    return common


def add_generate(sub, common) -> None:
    gen = sub.add_parser(
        "generate",
        parents=[common],
        help="answer one prompt with a RocketKVCache, compare with the full cache, report",
        description="Generate greedily with a RocketKVCache (the answer streams as it is decoded), then the same "
        "with the full cache (sdpa + DynamicCache), and report kept tokens, KV bytes, ms/token and whether the "
        "answers match.",
    )
    gen.add_argument("--prompt-file", default=None, help="UTF-8 text file with the prompt (e.g. a long document)")
    gen.add_argument("--prompt", default=None, help="prompt text; appended after --prompt-file's text")
    gen.add_argument("--max-new-tokens", type=int_at_least(1), default=64, help="tokens to generate (default 64)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument(
        "--prefill-chunk-size",
        type=int_at_least(0),
        default=DEFAULT_PREFILL_CHUNK,
        help=f"prefill the prompt this many tokens per forward, with a progress bar (default {DEFAULT_PREFILL_CHUNK}; "
        "0 = one forward)",
    )
    gen.add_argument(
        "--no-compare", action="store_true", help="skip the full-cache run (its answer, ms/token and match)"
    )
    gen.add_argument("--no-progress", action="store_true", help="no prefill progress bar")


def add_eval(sub, common) -> None:
    ev = sub.add_parser(
        "eval",
        parents=[common],
        help="compare methods on tasks (JSON, markdown, heat maps)",
        description="Run tasks x methods on the same samples; write results into --output.",
    )
    ev.add_argument(
        "--task",
        action="append",
        default=None,
        help="task name or loader:PATH, repeatable: passkey, niah_multikey, niah_multivalue, "
        "variable_tracking, common_words, fidelity, longbench:FILE.jsonl, ruler:FILE.jsonl",
    )
    ev.add_argument("--output", required=True, help="output folder")
    ev.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="full rocketkv stage1 stage2 streaming stage1_read streaming_read (default: all)",
    )
    ev.add_argument("--lengths", nargs="+", type=int_at_least(1), default=None, help="target prompt tokens of the grid")
    ev.add_argument("--depths", nargs="+", type=fraction, default=None, help="needle depths in [0, 1]")
    ev.add_argument(
        "--samples", type=int_at_least(0), default=None, help="samples per grid cell (rows per file for loaders)"
    )
    ev.add_argument("--seed", type=int_at_least(0), default=None)
    ev.add_argument(
        "--max-new-tokens", type=int_at_least(1), default=None, help="override every task's answer length"
    )
    ev.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    ev.add_argument("--fidelity-context", type=int_at_least(1), default=None)
    ev.add_argument("--fidelity-positions", type=int_at_least(1), default=None)
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = ShortErrorParser(
        prog="hf-rocketkv", description="RocketKV for Hugging Face transformers: generate, evaluate, benchmark."
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{generate,eval,bench,serve,warmup}", parser_class=ShortErrorParser
    )
    common = common_options()
    add_generate(sub, common)
    add_eval(sub, common)
    bench = sub.add_parser(
        "bench", add_help=False, help="decode benchmark (hf_rocketkv.bench.decode); other arguments pass through"
    )
    bench.add_argument("--config", default=None)
    warm = sub.add_parser(
        "warmup",
        parents=[common],
        help="compile RocketKV's decode path once and save the artifacts for later processes",
        description="Run one short generate() per batch size, then save Triton's and torch.compile's artifacts into "
        "--cache-dir; later processes call hf_rocketkv.use_compile_cache(DIR) before their first generate().",
    )
    warm.add_argument("--cache-dir", required=True, help="folder for the compile artifacts (created if missing)")
    warm.add_argument("--batch", type=int_at_least(1), nargs="+", default=[1], help="batch sizes to warm up")
    warm.add_argument("--context", type=int_at_least(1), default=1024, help="prompt tokens of the warm-up requests")
    warm.add_argument("--new-tokens", type=int_at_least(2), default=8)
    warm.add_argument("--regions", action="store_true", help="also compile_regions(model) (fused norms and MLPs)")
    warm.add_argument("--engine", action="store_true",
                      help="also warm up the batching engine of `hf-rocketkv serve` and generate_batch: every decode "
                      "bucket up to --max-running, then one batch per --batch size of --context-token prompts, over a "
                      "KV pool of --pool-gib (hf_rocketkv.warm_up_engine)")
    warm.add_argument("--pool-gib", type=float, default=None,
                      help="with --engine: the KV pool's size in GiB, as the server's (default: sized from the free "
                      "memory, as `hf-rocketkv serve` does)")
    warm.add_argument("--max-running", type=int_at_least(1), default=64,
                      help="with --engine: the server's --max-running (its decode buckets)")
    warm.add_argument("--warmup-max-tokens", type=int_at_least(0), default=4096,
                      help="with --engine: the largest max_tokens whose decode tables are covered; the server's "
                      "--warmup-max-tokens (default 4096, as the server's, whose default is its --default-max-tokens)")
    sub.add_parser(
        "serve", add_help=False,
        help="OpenAI-compatible server (hf_rocketkv.serving; needs `pip install hf_rocketkv[serve]`); "
        "`hf-rocketkv serve --help` for its options",
    )
    return parser
