"""Checks of everything the user names on the command line, run before the model loads.

Each failure raises UsageError with one message naming the input, the problem and the fix; the CLI prints it on
one to three lines and exits with status 2.
"""

from __future__ import annotations

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


def check_device(value: str | None) -> None:
    """``--device`` names a torch device this machine has."""
    if value is None:
        return
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {value}: not a torch device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {value}: CUDA is not available on this machine (torch {torch.__version__}); "
                             f"leave --device out to run on the CPU")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {value}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {value}: MPS is not available on this machine; leave --device out")


def check_output_folder(value: str) -> None:
    """``--output`` is a folder or does not exist yet (it is created)."""
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise UsageError(f"--output {value}: a file, not a folder; pass a folder to write the results into")


def check_task_files(specs: list[str], samples: int) -> None:
    """Tasks that read a user JSONL file (``longbench:PATH``, ``ruler:PATH``): the rows they will read parse."""
    from ..eval.tasks import get_task
    from ..eval.tasks.jsonl import read_jsonl, require

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
            rows = read_jsonl(path, samples)
            if not rows:
                raise ValueError("no rows: the file is empty")
            for number, row in enumerate(rows, 1):
                require(row, task.required_fields, path, number)
        except ValueError as err:
            raise UsageError(f"--task {spec}: {err}") from None
