"""``hf-rocketkv serve``: the OpenAI-compatible server from the command line.

    hf-rocketkv serve --model smollm2 --config smollm2-longdoc --host 127.0.0.1 --port 8000
    torchrun --nproc_per_node=2 -m hf_rocketkv.cli serve --model DIR --pool-gib 20     # tensor parallel (lockstep)

Under torchrun (WORLD_SIZE > 1) every rank loads its shard (``tp_plan="auto"``) and runs the batching engine in
lockstep (serving/parallel/lockstep.py): rank 0 listens and takes requests, the other ranks step with it and exit when
it stops.

By default the batching engine serves (continuous batching: every running request decodes in one forward) over a
KVBlockPool sized from the memory free once the model has loaded (0.9 of the free CUDA memory, or 0.25 of the
available RAM capped at 2 GiB: memory/sizing.py; ``--kv-memory-fraction`` or ``--pool-gib`` set it). A config the
batching engine cannot serve (multi_turn keep_all, decode_budget, token_budget, per-head budgets) runs on the
sequential engine instead, said in one line at start; ``--engine batching`` refuses it. The torch CPU threads are
chosen as for ``hf-rocketkv generate`` (cli/threads.py) unless ``--threads`` is given.

``serve_main(argv) -> int`` is the whole command (the ``hf-rocketkv`` entry point dispatches to it). Every argument,
the device, the config, the model's path and the port are checked before the model loads; a mistake is reported in
one to three lines with exit status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..models import DEFAULT_MODEL, first_line, shard_kv_heads
from .checks import UsageError, check_pool_gib
from .serve_options import (
    add_options,
    check_options,
    check_serve_device,
    check_serve_model,
    use_compile_cache_flag,
)
from .threads import choose_threads

PROG = "hf-rocketkv serve"
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
CONFIG_SECTION = "sparse_attention_config"
OTHER_SECTIONS = ("eval",)  # sections of other commands that a shared config file may hold
GRACEFUL_SHUTDOWN_S = 10  # in-flight requests' time to finish after Ctrl-C / SIGTERM


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (not the whole usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG, description="Serve a model with RocketKV through an OpenAI-compatible HTTP API.")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="'smollm2' (embedded default), a local checkpoint folder or a .gguf file")
    parser.add_argument("--config", default=None,
                        help="YAML with a sparse_attention_config section, or a bundled config by name "
                             f"({', '.join(sorted(p.stem for p in CONFIG_DIR.glob('*.yaml')))})")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="model id clients send (default: --model's name)")
    parser.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429 (default 64)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="context limit, prompt + max_tokens (default: the model's max_position_embeddings)")
    parser.add_argument("--default-max-tokens", type=int, default=4096,
                        help="max_tokens of chat requests that give none (default 4096, capped by the context; "
                             "RocketKV preallocates decode slots for max_tokens)")
    parser.add_argument("--pool-gib", type=float, default=None,
                        help="the KV block pool's size in GiB (default: --kv-memory-fraction of the free memory); "
                             "per GPU under torchrun, where it is required")
    parser.add_argument("--kv-memory-fraction", type=float, default=None,
                        help="without --pool-gib, the pool takes this fraction of the memory free once the model "
                             "has loaded (default 0.9 of the free CUDA memory; on the CPU 0.25 of the available RAM, "
                             "at most 2 GiB)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="the pool's K/V pages: auto (default) in the model's dtype; fp8: e4m3 with one scale per "
                             "page, half the bytes of bf16 (twice the pages in --pool-gib), read back in the model's "
                             "dtype")
    parser.add_argument("--engine", default="auto", choices=["auto", "batching", "sequential"],
                        help="batching: continuous batching over the KV block pool (every running request decodes "
                             "in one forward); sequential: one request at a time through generate(); auto (default): "
                             "batching, or sequential for a config the batching engine cannot serve (said at start)")
    parser.add_argument("--max-running", type=int, default=64,
                        help="batching engine: requests decoding at once (default 64, at most 128)")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=None,
                        help="batching engine: the most prompt tokens of one prefill forward; longer prompts are "
                             "prefilled in chunks while the running requests decode (default 8192)")
    parser.add_argument("--prefill-token-budget", type=int, default=None,
                        help="batching engine: prompt tokens earned per decode step while requests decode; lower it "
                             "to keep their decode rate while long prompts arrive, at the cost of those prompts' "
                             "first token (default 8192; docs/engine.md, Chunked prefill)")
    parser.add_argument("--concurrent-prefill-tokens", type=int, default=None,
                        help="batching engine: prefill beside the decode steps (a thread and CUDA stream of its own) "
                             "in chunks of this many tokens, so running requests never wait for a prefill chunk "
                             "(e.g. 512; default: chunks between decode steps; docs/engine.md)")
    parser.add_argument("--warmup-max-tokens", type=int, default=None,
                        help="batching engine on CUDA: capture every decode graph at startup for requests of up to "
                             "this many max_tokens (default: --default-max-tokens; 0: capture lazily while serving)")
    parser.add_argument("--compile-cache", default=None, metavar="DIR",
                        help="hf_rocketkv.use_compile_cache(DIR) before the model loads: the Triton kernels that "
                             "`hf-rocketkv warmup --engine --cache-dir DIR` compiled are loaded, not compiled again "
                             "(docs/engine.md, Warm start)")
    parser.add_argument("--compile-regions", action="store_true",
                        help="torch.compile the model's RMSNorm and MLP modules (hf_rocketkv.compile_regions): fused "
                             "kernels in prefill and in the decode graphs; compiled at startup during the capture")
    parser.add_argument("--no-overlap-decode", dest="overlap_decode", action="store_false",
                        help="batching engine: read every decode step's tokens before launching the next one "
                             "(default: the next step is launched first, so the GPU never waits for the host)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: where the model loads, CPU)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: as hf-rocketkv generate, the physical cores this process "
                             "may use, fewer when the machine is busy; OMP_NUM_THREADS is respected)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_options(parser)  # --api-key, --chat-template, --set (cli/serve_options.py)
    return parser


def load_config(value: str | None):
    """A RocketKVConfig from a YAML path or a bundled config name; other commands' sections (eval) are ignored."""
    import yaml

    from ..config import RocketKVConfig

    if value is None:
        return RocketKVConfig()
    path = Path(value)
    if not path.exists() and (CONFIG_DIR / f"{value}.yaml").is_file():
        path = CONFIG_DIR / f"{value}.yaml"
    if not path.is_file():
        raise UsageError(f"--config {value}: no such file (nor a bundled config of that name)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UsageError(f"--config {value}: invalid YAML{where}: {problem}") from err
    if not isinstance(data, dict):
        raise UsageError(f"--config {value}: expected a mapping with a '{CONFIG_SECTION}' section")
    if CONFIG_SECTION in data:
        extra = sorted(set(data) - {CONFIG_SECTION, *OTHER_SECTIONS})
        if extra:
            raise UsageError(f"--config {value}: unknown top-level key(s) {extra}; allowed: "
                             f"{[CONFIG_SECTION, *OTHER_SECTIONS]}")
        section = data[CONFIG_SECTION]
    else:  # a flat mapping of fields (other commands' sections left aside)
        section = {key: item for key, item in data.items() if key not in OTHER_SECTIONS}
    try:
        return RocketKVConfig.from_dict({CONFIG_SECTION: section})
    except ValueError as err:
        raise UsageError(f"--config {value}: {err}") from err


def check_args(args: argparse.Namespace) -> None:
    """The numbers and flag combinations (no file, device or model read yet)."""
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queue < 1:
        raise UsageError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise UsageError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    if args.default_max_tokens < 1:
        raise UsageError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    check_pool_gib(args.pool_gib)
    if args.kv_memory_fraction is not None:
        if not 0 < args.kv_memory_fraction <= 1:
            raise UsageError(f"--kv-memory-fraction must be in (0, 1], got {args.kv_memory_fraction}")
        if args.pool_gib is not None:
            raise UsageError("--kv-memory-fraction and --pool-gib both size the KV pool: give one of them")
    if not 1 <= args.max_running <= 128:
        raise UsageError(f"--max-running must be in [1, 128], got {args.max_running}")
    for flag in ("prefill_chunk_tokens", "prefill_token_budget", "concurrent_prefill_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup_max_tokens is not None and args.warmup_max_tokens < 0:
        raise UsageError(f"--warmup-max-tokens must be >= 0 (0: no startup capture), got {args.warmup_max_tokens}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    world = world_size()
    if world > 1:
        if args.pool_gib is None or args.engine == "sequential":
            raise UsageError(f"under torchrun (WORLD_SIZE={world}) serve runs the batching engine in lockstep on "
                             f"every rank, over pools of one size: give --pool-gib (and --engine auto or batching)")
        if args.device is not None:
            raise UsageError(f"--device {args.device} under torchrun (WORLD_SIZE={world}): each rank uses its own "
                             f"device (LOCAL_RANK); leave --device unset")
        if args.concurrent_prefill_tokens is not None:
            raise UsageError(f"--concurrent-prefill-tokens under torchrun (WORLD_SIZE={world}): the ranks decide in "
                             f"lockstep and a prefill thread's progress depends on timing; leave it unset")




@dataclass(frozen=True)
class EnginePlan:
    """Which engine serves, whether it has a KV block pool, and the line said at start when ``--engine auto``
    chose the sequential engine (None otherwise)."""

    name: str  # "batching" or "sequential"
    pool: bool
    note: str | None = None


def plan_engine(args: argparse.Namespace, config, sliding: bool = False) -> EnginePlan:
    """The engine for these flags and this config, decided before the model loads: ``auto`` is the batching engine
    over a pool, or the sequential engine for a config the batching engine cannot serve (one line says which field
    and why); ``--engine batching`` (and torchrun) refuses those. A model with sliding-window layers (``sliding``)
    plans as any other (its pool holds a window per request for those layers, in the model's dtype under fp8
    pages). The sequential engine has a pool only with ``--pool-gib`` (accounting: admission and the
    free-pages metric)."""
    from ..serving.builder import batching_refusal

    refusal = batching_refusal(config)
    where = f"--config {args.config} sets"
    world = world_size()
    if args.engine == "batching" or world > 1:
        if refusal is not None:
            asked = "--engine batching" if world == 1 else f"under torchrun (WORLD_SIZE={world}) the batching engine"
            fix = "use --engine sequential or leave --engine out" if world == 1 else "serve it without torchrun"
            raise UsageError(f"{asked}: {where} {refusal}; {fix}")
        return EnginePlan("batching", True)
    if args.engine == "auto" and refusal is None:
        return EnginePlan("batching", True)
    note = None
    why = "--engine sequential"
    if args.engine == "auto":
        note = f"sequential engine, one request at a time: {where} {refusal}"
        why = f"{where} {refusal.split(' (')[0]}"
    pool = args.pool_gib is not None
    if pool:
        from ..cache import check_pool_policy

        try:  # the config is what is refused (KVBlockPool.check_config would say the same after the model loads)
            check_pool_policy(config)
        except ValueError as err:
            raise UsageError(f"--config {args.config} with --pool-gib: {err}") from None
    if args.kv_cache_dtype != "auto" and not pool:
        raise UsageError(f"--kv-cache-dtype {args.kv_cache_dtype} sets the KV pool's page dtype, and the sequential "
                         f"engine ({why}) has a pool only with --pool-gib: give --pool-gib too")
    if args.kv_memory_fraction is not None:
        raise UsageError(f"--kv-memory-fraction sizes the batching engine's pool; the sequential engine ({why}) has "
                         f"a pool only with --pool-gib")
    return EnginePlan("sequential", pool, note)


def world_size() -> int:
    """Ranks started by torchrun (1 without it)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        raise UsageError(f"WORLD_SIZE must be an integer, got {os.environ['WORLD_SIZE']!r}") from None


def is_leader_rank() -> bool:
    """Rank 0 listens and takes requests (the only rank without torchrun)."""
    return int(os.environ.get("RANK", "0")) == 0


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind now, before the model loads, so a taken port fails in a second rather than after a minute."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {err.strerror or err}") from err
    return sock


def set_threads(args: argparse.Namespace) -> str:
    """Set torch's CPU threads as ``hf-rocketkv generate`` does (``--threads``, else OMP_NUM_THREADS, else the
    automatic choice of cli/threads.py); returns the line that says what was chosen and why."""
    import torch

    choice = choose_threads(args.threads)
    if choice is None:
        return f"{torch.get_num_threads()} CPU thread(s), from OMP_NUM_THREADS"
    torch.set_num_threads(choice.count)
    return f"{choice.count} CPU thread(s), {choice.reason}"


def load_model(args: argparse.Namespace):
    """``(model, tokenizer)`` (the slow part); under torchrun each rank loads its shard. A path, config,
    architecture or tokenizer that cannot be used is reported before any weight is read."""
    import torch

    from ..models import DefaultModelMissing, ModelSourceError, load_model_and_tokenizer

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    try:
        return load_model_and_tokenizer(args.model, dtype=dtype, device=args.device,
                                        tp_plan="auto" if world_size() > 1 else None)
    except ModelSourceError as err:  # its message starts with the path
        raise UsageError(f"--model {err}") from None
    except DefaultModelMissing as err:
        raise UsageError(f"--model {args.model}: {err}") from None
    except (OSError, ValueError) as err:
        raise UsageError(f"cannot load --model {args.model}: {first_line(err)}") from None


def build_pool(args: argparse.Namespace, model, config, plan: EnginePlan):
    """``(pool, line)``: the plan's KVBlockPool (``--pool-gib``, else sized from the memory free now that the model
    has loaded: memory/sizing.py) and the line that says its size; ``(None, None)`` without one."""
    if not plan.pool:
        return None, None
    import torch

    from ..memory import KVBlockPool, auto_pool_size, model_prefill_reserve

    world = world_size()
    # under tensor parallelism --pool-gib is per GPU: each rank's pages, and its prompts' dense K/V kept for the
    # prefill reserve, hold its shard's KV heads only (model_prefill_reserve says why the activations count whole)
    kv_heads = shard_kv_heads(model, world) if world > 1 else None
    if args.pool_gib is not None:
        nbytes, how = int(args.pool_gib * 2**30), "--pool-gib"
    else:
        size = auto_pool_size(next(model.parameters()).device, args.kv_memory_fraction,
                              reserve=model_prefill_reserve(model, kv_heads))
        nbytes, how = size.bytes, size.describe()
    try:
        pool = KVBlockPool(model, max_gpu_bytes=nbytes, kt_page_size=config.page_size,
                           kt_dtype=config.kt_cache_dtype,
                           dtype=torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else None,
                           num_kv_heads=kv_heads)
    except ValueError as err:
        raise UsageError(f"KV pool of {nbytes / 2**30:.3g} GiB ({how}): {err}; give a larger --pool-gib") from None
    line = (f"{plan.name} engine, KV pool {nbytes / 2**30:.2f} GiB ({how}): {pool.total_pages()} pages of "
            f"{pool.page_size} tokens")
    return pool, line


def batching_config(args: argparse.Namespace):
    """The batching engine's ``BatchingConfig`` from the flags (chunked-prefill settings left at their defaults
    unless given)."""
    from ..serving.batching.scheduler import BatchingConfig

    chunking = {flag: getattr(args, flag) for flag in ("prefill_chunk_tokens", "prefill_token_budget",
                                                       "concurrent_prefill_tokens")
                if getattr(args, flag) is not None}
    return BatchingConfig(max_running=args.max_running, max_queue=args.max_queue, overlap_decode=args.overlap_decode,
                          **chunking)


@dataclass
class PendingManager:
    """The engine is built (a config it refuses was refused already); ``finish()`` warms it up and returns the
    started GenerationManager. The server listens meanwhile, /health at 503 with ``reason``
    (serving/http/startup.py)."""

    finish: Callable[[], object]
    max_model_len: int
    reason: str

    def stop(self, drain: bool = True, timeout: float | None = None) -> None:
        """Never finished: nothing runs."""


def build_manager(args: argparse.Namespace, config, plan: EnginePlan, model, tokenizer, pool):
    """The plan's engine and its GenerationManager. On one process: the engine is built now (so that a config it
    refuses exits 2 before the server starts) and a ``PendingManager`` returned, whose ``finish`` runs the startup
    capture and starts the manager while the server already answers /health. Under torchrun (built and warmed up
    now, in step with every rank): on rank 0 a manager over a lockstep engine; on the other ranks the started
    follower engine (``BatchingEngine``)."""
    from ..serving import GenerationManager, build_engine
    from ..serving.builder import warm_up_batching

    prepare_model(model, args)
    batching = batching_config(args)
    max_model_len = args.max_model_len or model.config.get_text_config().max_position_embeddings
    if world_size() > 1:
        from ..serving.parallel.lockstep import Lockstep

        engine = build_engine(model, config, pool=pool, engine="batching", batching=batching,
                              max_queue=args.max_queue, warmup_max_tokens=warmup_max_tokens(args),
                              max_model_len=max_model_len, lockstep=Lockstep())
        if not engine.lockstep.is_leader:
            return engine
        return GenerationManager(model, tokenizer, config, engine=engine, pool=pool, max_queue=args.max_queue,
                                 max_model_len=args.max_model_len, batching=batching,
                                 warmup_max_tokens=warmup_max_tokens(args))
    engine = build_engine(model, config, pool=pool, engine=plan.name, batching=batching, max_queue=args.max_queue,
                          max_model_len=max_model_len)

    def finish():
        if plan.name == "batching":
            warm_up_batching(engine, warmup_max_tokens(args), max_model_len)
        return GenerationManager(model, tokenizer, config, engine=engine, pool=pool, max_queue=args.max_queue,
                                 max_model_len=args.max_model_len, batching=batching)

    capture = plan.name == "batching" and warmup_max_tokens(args) > 0 and getattr(engine, "graphs_in_use", False)
    reason = (f"capturing the batching engine's decode graphs for requests of up to {warmup_max_tokens(args)} "
              f"max_tokens, then building its prefill attention graphs" if capture else "starting the engine")
    return PendingManager(finish, int(max_model_len), reason)


def prepare_model(model, args: argparse.Namespace) -> None:
    """What the flags change in the loaded model before the engine starts: ``--compile-regions`` compiles its norms
    and MLPs in place (lazily: the first forwards compile, i.e. the startup capture when there is one)."""
    if args.compile_regions:
        from ..integration.regions import compile_regions

        compile_regions(model)


def warmup_max_tokens(args: argparse.Namespace) -> int:
    """The max_tokens the startup capture covers: ``--warmup-max-tokens``, else ``--default-max-tokens`` (the
    max_tokens of every chat request that gives none: covering it keeps those requests from capturing mid-serve)."""
    return args.default_max_tokens if args.warmup_max_tokens is None else args.warmup_max_tokens


def served_name(args: argparse.Namespace) -> str:
    if args.served_model_name:
        return args.served_model_name
    return Path(str(args.model)).stem if args.model != DEFAULT_MODEL else DEFAULT_MODEL


def serve_main(argv: list[str] | None = None) -> int:
    """Run the server until interrupted (Ctrl-C / SIGTERM: in-flight requests get up to 10 s, then are cancelled).
    Returns the exit status: 0 after a requested stop, 2 for a usage, config or model-loading error."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed its message
        return int(exit_.code or 0)
    sock = None
    try:  # everything that can be checked before the model loads, cheapest first
        from ..serving.http.deps import require_serve_deps

        require_serve_deps(load=False)  # looked for, not imported: the server module imports them
        check_args(args)
        check_serve_device(args.device)
        # device, model path, key, template; --set applied
        config, app_options = check_options(args, load_config(args.config))
        sliding = check_serve_model(args.model)
        plan = plan_engine(args, config, sliding)
        if is_leader_rank():  # under torchrun only rank 0 listens
            sock = bind_socket(args.host, args.port)
    except (UsageError, ImportError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2

    def say(line: str | None) -> None:
        if line is not None and sock is not None:  # rank 0 speaks for every rank
            print(f"{PROG}: {line}", file=sys.stderr, flush=True)

    try:
        say(plan.note)
        say(set_threads(args))
        say(use_compile_cache_flag(args))
        model, tokenizer = load_model(args)
        pool, pool_line = build_pool(args, model, config, plan)
        say(pool_line)
        manager = build_manager(args, config, plan, model, tokenizer, pool)
    except (UsageError, NotImplementedError) as err:  # NotImplementedError: an engine refusing the config
        if sock is not None:
            sock.close()
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except (MemoryError, torch_out_of_memory()) as err:  # the weights, or the startup capture on CUDA
        if sock is not None:
            sock.close()
        print(f"{PROG}: error: out of memory ({first_line(err)}); lower --kv-memory-fraction or --pool-gib, or "
              f"use a smaller --dtype", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        if sock is not None:
            sock.close()
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    if sock is None:  # a follower rank: step with rank 0 until it stops
        from ..serving.parallel.lockstep import LockstepDiverged

        # Ctrl-C reaches every rank under torchrun; rank 0 decides when to stop and ends every engine with its last
        # inbox: a follower that left at once would leave rank 0's last steps waiting in their collectives
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            manager.follow()
        except LockstepDiverged as err:  # exit, so that torchrun stops every rank instead of leaving them waiting
            print(f"{PROG}: error: {err}", file=sys.stderr)
            return leave_distributed(1)
        return leave_distributed(0)
    ran, failed = manager, False
    try:
        ran, failed = _run(manager, served_name(args), sock, args, app_options, tokenizer)
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled: the user asked for a stop
        pass
    finally:
        ran.stop(drain=False, timeout=30)
        sock.close()
    return leave_distributed(1 if failed else 0)


def torch_out_of_memory() -> type[BaseException]:
    """torch's out-of-memory error (CUDA's, a RuntimeError subclass)."""
    import torch

    return torch.OutOfMemoryError


def leave_distributed(code: int) -> int:
    """``code``; under torchrun (a process group is up), the process ends here with it, without interpreter
    finalization: the model's DTensor shards keep the gloo group alive, and gloo's threads meeting a half torn-down
    interpreter abort now and then ("terminate called without an active exception", pytorch/pytorch#179291) after
    the server has stopped cleanly. The engines have ended and the socket is closed by then; streams are flushed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run(manager, model_name: str, sock: socket.socket, args: argparse.Namespace, app_options: dict,
         tokenizer=None):
    """Serve until stopped (``app_options``: ``create_app``'s key and chat template, ``check_options``); returns the
    manager that ran (a ``PendingManager``'s, once finished, else itself) and whether its start failed. A
    ``PendingManager`` is finished on a thread while the server answers /health with 503 and the reason; a failure
    there stops the server."""
    import uvicorn

    from ..serving.http.server import create_app
    from ..serving.http.startup import Starting, start_when_ready
    from ..serving.http.state import server_state

    pending = manager if isinstance(manager, PendingManager) else None
    served = Starting(pending.max_model_len, tokenizer, pending.reason) if pending is not None else manager
    app = create_app(served, model_name, default_max_tokens=args.default_max_tokens, aliases=(str(args.model),),
                     **app_options)
    host, port = sock.getsockname()[:2]
    print(f"{PROG}: serving {model_name!r} on http://{host}:{port}/v1"
          f"{f' (/health answers 503 until ready: {pending.reason})' if pending is not None else ''}",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level=args.log_level, lifespan="off",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = uvicorn.Server(config)
    failed: list[BaseException] = []
    if pending is not None:
        def on_failure(err: BaseException) -> None:
            hint = ("; lower --kv-memory-fraction or --pool-gib, or --warmup-max-tokens"
                    if isinstance(err, (MemoryError, torch_out_of_memory())) else "")
            print(f"{PROG}: error: the engine failed to start: {first_line(err)}{hint}", file=sys.stderr, flush=True)
            failed.append(err)
            server.should_exit = True

        def ready():
            built = pending.finish()
            print(f"{PROG}: ready ({pending.reason}: done)", file=sys.stderr, flush=True)
            return built

        thread = start_when_ready(app, ready, on_failure)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled: the user asked for a stop
        pass
    finally:
        if pending is not None:
            thread.join()  # a stop during the warm-up waits for it: its manager must be stopped too
    return server_state(app).manager, bool(failed)
