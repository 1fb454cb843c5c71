"""The ``hf-rocketkv`` command line: ``main(argv)`` returns the exit status (see ``hf_rocketkv/cli/main.py``).

    parser.py   flags, help texts, range checks at parse time
    checks.py   inputs checked before the model loads (config, files, device), UsageError
    threads.py  the default number of torch CPU threads
    runs.py     one timed, streamed generate() call with a prefill progress bar
    report.py   the generate report
    main.py     the commands and the error handling (1-3 lines, exit status 2, --debug for the traceback)
"""

from .checks import UsageError, apply_overrides, resolve_config_path
from .main import main
from .parser import CONFIG_DIR, build_parser, bundled_configs
from .report import compact_list

__all__ = [
    "CONFIG_DIR",
    "UsageError",
    "apply_overrides",
    "build_parser",
    "bundled_configs",
    "compact_list",
    "main",
    "resolve_config_path",
]
