"""The prefill path's Triton kernels compile once for every prompt length.

Triton compiles a kernel again for every new combination of its integer arguments' specialisations (divisible by 16,
equal to 1). An argument derived from the prompt length therefore compiles a new kernel, ~0.5 s, in the middle of
the first request whose length meets a new combination: on an H100 the first 64 requests of 512-16k tokens met five
such compiles (the merge kernel and stage 1's window-score kernels;
``results/h100_2026-11-28_batching_u64_triton_two_procs_a.json``).
These kernels take such arguments unspecialised (the RoPE kernel's token count stays specialised on being 1: the
decode step's kernel is another one), so the engine's warm-up compiles everything a prompt of any length runs.
"""

from __future__ import annotations

import pytest

from hf_rocketkv.kernels import compact, kt_build, merge_attention, rope, window_scores

# (kernel, arguments never specialised, arguments specialised on == 1 only)
PROMPT_LENGTH_ARGUMENTS = [
    (window_scores._window_stats_kernel, {"chunk", "num_chunks"}, set()),
    (window_scores._window_accum_kernel, {"num_slots", "num_chunks"}, set()),
    (merge_attention._merge_kernel, {"queries"}, set()),
    (rope._rope_kernel, set(), {"tokens"}),
    (kt_build._build_kt_kernel, {"num_pages"}, set()),
    (compact._compact_row_kernel, {"n", "row_pages", "num_kt_pages"}, set()),
]


def specialisation(kernel) -> dict[str, tuple[bool, bool]]:
    """``{argument: (never specialised, specialised on == 1 only)}`` of a Triton kernel, compiled (a JITFunction) or
    run by the interpreter (TRITON_INTERPRET=1, as in CI: its wrapper keeps the decorator's arguments)."""
    if hasattr(kernel, "params"):
        return {p.name: (bool(p.do_not_specialize), bool(p.do_not_specialize_on_alignment)) for p in kernel.params}
    never = set(kernel.kwargs.get("do_not_specialize") or ())
    alignment = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
    return {name: (name in never, name in alignment) for name in kernel.arg_names}


@pytest.mark.parametrize("kernel, never, alignment_only", PROMPT_LENGTH_ARGUMENTS,
                         ids=[k.fn.__name__ for k, _, _ in PROMPT_LENGTH_ARGUMENTS])
def test_prompt_length_arguments_are_not_specialised(kernel, never, alignment_only):
    flags = specialisation(kernel)
    assert never | alignment_only <= set(flags), sorted(flags)
    for name in never:
        assert flags[name][0], name
    for name in alignment_only:
        assert flags[name] == (False, True), name
