"""Checks of everything the user names on the command line, run before the model loads.

Each failure raises UsageError with one message naming the input, the problem and the fix; the CLI prints it on
one to three lines and exits with status 2.
"""

from __future__ import annotations

import glob
import importlib.util
import math
import re
import sys
from pathlib import Path

from .parser import CONFIG_DIR, bundled_configs


class UsageError(ValueError):
    """A mistake in the command line, the config or an input file: reported in 1-3 lines, exit status 2."""


def resolve_config_path(value: str | None) -> Path | None:
    """A YAML path, or the name of a bundled config (``default``, ``smollm2-cpu``, ...)."""
    if value is None:
        return None
    path = Path(value)
    if not path.exists() and (CONFIG_DIR / f"{value}.yaml").is_file():
        return CONFIG_DIR / f"{value}.yaml"
    if not path.is_file():
        raise UsageError(
            f"--config {value}: no such file; pass a YAML file or a bundled config: {', '.join(bundled_configs())}"
        )
    return path


def apply_overrides(config, assignments: list[str]):
    """``["prompt_budget=512", "kt_cache_dtype=bfloat16"]`` applied to a RocketKVConfig (values parsed as YAML)."""
    import yaml

    from ..config import RocketKVConfig

    changes = {}
    for item in assignments:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set prompt_budget=512")
        try:
            changes[name.strip()] = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ValueError(f"--set {item!r}: the value is not valid YAML; quote text values") from None
    if not changes:
        return config
    try:
        return RocketKVConfig.from_dict({**config.to_dict(), **changes})
    except ValueError as err:
        raise ValueError(f"--set {' '.join(assignments)}: {err}") from err


def read_text_file(flag: str, value: str) -> str:
    """The UTF-8 text of a user-named file, or UsageError saying why it cannot be read."""
    path = Path(value).expanduser()
    if not path.exists():
        raise UsageError(f"{flag} {value}: no such file")
    if not path.is_file():
        raise UsageError(f"{flag} {value}: a folder, not a file; pass a UTF-8 text file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UsageError(
            f"{flag} {value}: not UTF-8 text (byte {err.start} cannot be decoded); pass a plain text file"
        ) from None
    except OSError as err:
        raise UsageError(f"{flag} {value}: cannot be read ({err.strerror})") from None


def prompt_text(prompt_file: str | None, prompt: str | None) -> str:
    """The prompt: the file's text, a blank line, then ``--prompt`` (either may be absent, not both, not empty)."""
    if prompt_file is None and prompt is None:
        raise UsageError("generate needs --prompt-file and/or --prompt, e.g. --prompt 'What is a KV cache?'")
    parts = []
    if prompt_file is not None:
        text = read_text_file("--prompt-file", prompt_file)
        if not text.strip():
            raise UsageError(f"--prompt-file {prompt_file}: the file is empty; put the document or question in it")
        parts.append(text)
    if prompt is not None:
        if not prompt.strip():
            raise UsageError("--prompt is empty; give the question or instruction, e.g. --prompt 'Summarise it.'")
        parts.append(prompt)
    return "\n\n".join(parts)


# device types torch.device() parses (its error message lists them); checked here without importing torch
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "hpu", "mtia", "ipu", "xla", "lazy", "meta", "mkldnn", "opengl", "opencl",
                "ideep", "hip", "ve", "fpga", "maia", "vulkan", "privateuseone")
DEVICE = re.compile(r"(?P<type>[a-z_]+)(?::(?P<index>\d+))?")


def torch_build() -> tuple[str | None, bool | None]:
    """(torch's version, whether its build has CUDA or ROCm) read from ``torch/version.py`` without importing torch;
    (None, None) where that file cannot be read."""
    spec = importlib.util.find_spec("torch")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        try:
            text = (Path(folder) / "version.py").read_text(encoding="utf-8")
        except OSError:
            continue
        version = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        gpu = [re.search(rf"^{name}\s*(?::[^=]*)?=\s*(.+?)\s*$", text, re.MULTILINE) for name in ("cuda", "hip")]
        if version is None or None in gpu:
            return None, None
        return version.group(1), any(match.group(1) != "None" for match in gpu)
    return None, None


# an NVIDIA driver (/proc/driver/nvidia, /dev/nvidia*), WSL's GPU bridge (/dev/dxg) or ROCm's device (/dev/kfd)
GPU_TRACES = ("/proc/driver/nvidia", "/dev/nvidia*", "/dev/dxg", "/dev/kfd")


def cuda_absent_reason(traces: tuple[str, ...] = GPU_TRACES, platform: str = sys.platform) -> str | None:
    """Why this machine surely has no CUDA device, found in about a millisecond without importing torch: torch is a
    build without CUDA or ROCm, or (on Linux) no GPU driver is present, or it is macOS. None means it may have one
    (torch is asked)."""
    version, gpu_build = torch_build()
    if gpu_build is False:
        return f"torch {version} is a build without CUDA"
    if platform == "darwin":
        return "CUDA does not run on macOS"
    if platform.startswith("linux") and not any(glob.glob(trace) for trace in traces):
        return "no NVIDIA driver is loaded (no /proc/driver/nvidia, no /dev/nvidia*)"
    return None


def check_device(value: str | None, flag: str = "--device") -> None:
    """``--device`` names a torch device this machine has (the spelling, and CUDA's absence where it is sure, are
    checked before torch is imported)."""
    if value is None:
        return
    match = DEVICE.fullmatch(value.strip())
    if match is None or match.group("type") not in DEVICE_TYPES:
        raise UsageError(f"{flag} {value}: not a torch device; use cpu, cuda or cuda:N")
    kind, index = match.group("type"), match.group("index")
    if kind == "meta":
        raise UsageError(f"{flag} {value}: meta tensors hold no data, so nothing can run there; use cpu or cuda")
    if kind == "cpu":
        return
    if kind == "cuda" and (reason := cuda_absent_reason()) is not None:
        raise UsageError(f"{flag} {value}: CUDA is not available on this machine ({reason}); leave {flag} out to "
                         f"run on the CPU")
    import torch

    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"{flag} {value}: CUDA is not available on this machine (torch {torch.__version__}); "
                             f"leave {flag} out to run on the CPU")
        if index is not None and int(index) >= torch.cuda.device_count():
            raise UsageError(f"{flag} {value}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                             f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    elif kind == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"{flag} {value}: MPS is not available on this machine; leave {flag} out")
    else:
        backend = getattr(torch, kind, None)
        available = getattr(backend, "is_available", None)
        if available is None or not available():
            raise UsageError(f"{flag} {value}: no {kind} device is available here; use cpu or cuda")


def check_model(value: str | None) -> None:
    """``--model`` is the default name, a ``.gguf`` file or a checkpoint folder (files only: the config and the
    architecture are read when the model loads, still before any weight)."""
    from ..models import DefaultModelMissing, ModelSourceError, model_source

    try:
        model_source(value)
    except ModelSourceError as err:  # its message starts with the path
        raise UsageError(f"--model {err}") from err
    except DefaultModelMissing as err:
        raise UsageError(f"--model {value}: {err}") from err


def check_pool_gib(value: float | None) -> None:
    """``--pool-gib`` (serve, warmup --engine): None, or a finite number of GiB > 0."""
    if value is not None and not 0 < value < math.inf:
        raise UsageError(f"--pool-gib must be > 0, got {value} (a finite number of GiB)")


def check_folder(flag: str, value: str, what: str) -> None:
    """``value`` is a folder or does not exist yet (it is created); ``what`` says what goes in it."""
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {value}: a file, not a folder; pass a folder {what}")


def check_output_folder(value: str) -> None:
    """``--output`` is a folder or does not exist yet (it is created)."""
    check_folder("--output", value, "to write the results into")


def check_task_files(specs: list[str]) -> None:
    """Tasks that read a user JSONL file (``longbench:PATH``, ``ruler:PATH``): every line of the file is checked (JSON,
    an object, the fields the task reads), not only the rows a run will read."""
    from ..eval.tasks import get_task
    from ..eval.tasks.jsonl import validate_jsonl

    for spec in specs:
        try:
            task = get_task(spec)
        except ValueError as err:
            raise UsageError(str(err)) from None
        path = getattr(task, "path", None)
        if path is None:
            continue
        if not Path(path).is_file():
            raise UsageError(f"--task {spec}: no such file; pass a JSONL file with one JSON object per line")
        try:
            validate_jsonl(path, task.fields)
        except ValueError as err:
            raise UsageError(f"--task {spec}: {err}") from None
        except OSError as err:
            raise UsageError(f"--task {spec}: cannot be read ({err.strerror})") from None
