"""Markers shared by the test folders: ``slow`` for the cases left out of the default command (``-m "not slow"``;
CI runs them all), chosen by their measured durations (docs/testing.md, "Markers")."""

from __future__ import annotations

import pytest

SLOW = pytest.mark.slow


def slow_except(values, keep) -> list:
    """``values`` for ``parametrize``, every one but those in ``keep`` marked ``slow``: the default command runs the
    kept cases, CI all of them."""
    return [value if value in keep else pytest.param(value, marks=SLOW) for value in values]


# Cases of tests parametrized through a module fixture, too slow for the default command: a fixture's parameter
# cannot carry a mark for one test only, so tests/conftest.py marks these by node id (tests/test_markers.py checks
# that each still names a test).
SLOW_FIXTURE_CASES = (
    "tests/integration/test_hybrid_pool.py::test_graphed_decode_on_the_pool_equals_eager_and_reads_nothing_back[gpt_oss]",
    "tests/serving/test_hybrid_batching.py::test_a_replayed_batched_step_reads_nothing_back_from_the_device[gpt_oss]",
)


# The default command's slowest cases on the 2-core machine, by node id: each took 2.3 s or more of one worker's time
# (``python -m pytest -q -n 2 -m "not slow" --durations=150``, idle machine, 2026-12-02), together ~40% of the run.
# Parametrized families keep at least one case in the default command; CI runs them all.
SLOW_MEASURED_CASES = (
    "tests/bench/test_decode.py::test_decode_bench_pool_rows_quick",
    "tests/bench/test_decode_under_arrivals.py::test_quick_run_measures_every_setting",
    "tests/bench/test_packed_steps_script.py::test_quick_run_times_both_modes_and_counts_packed_forwards",
    "tests/bench/test_hybrid_decode_bench.py::test_quick_run_writes_every_row_and_the_ratios",
    "tests/bench/test_peak_memory_cpu.py::test_row_group_prefill_peak_is_one_cold_row",
    "tests/bench/test_perf_guard.py::test_the_quick_run_measures_every_case_on_the_cpu_and_writes_its_result",
    "tests/bench/test_profile_tools.py::test_decode_host_time_quick_profiles_only_the_decode_steps",
    "tests/bench/test_workload.py::test_workload_bench_quick",
    "tests/cache/test_decode_compression.py::test_graphed_and_compiled_runners_equal_eager[torch_compile]",
    "tests/cache/test_fp8_pool.py::test_compiled_decode_on_fp8_pages_equals_eager[head]",
    "tests/cache/test_fp8_pool.py::test_compiled_decode_on_fp8_pages_equals_eager[page]",
    "tests/cache/test_layer_plan.py::test_triton_backend_runs_the_layer_plan_like_the_reference",
    "tests/cache/test_pool_lifetime.py::test_pool_requests::runTest",
    "tests/cache/test_pool_pages.py::test_triton_backend_with_pool_equals_torch_backend",
    "tests/cli/test_serve.py::test_bad_config_values_and_port_in_use",
    "tests/cli/test_serve.py::test_import_without_the_serve_extra",
    "tests/cli/test_serve.py::test_usage_errors_are_short_and_exit_2[argv5---kv-cache-dtype fp8 sets the KV pool's page dtype]",
    "tests/cli/test_serve_defaults.py::test_every_mistake_is_short_exits_2_and_loads_no_model[--config adakv.yaml --engine batching]",
    "tests/cli/test_serve_defaults.py::test_every_mistake_is_short_exits_2_and_loads_no_model[--config adakv.yaml --pool-gib 1]",
    "tests/cli/test_serve_defaults.py::test_every_mistake_is_short_exits_2_and_loads_no_model[--config broken.yaml]",
    "tests/cli/test_serve_defaults.py::test_every_mistake_is_short_exits_2_and_loads_no_model[--config keep_all.yaml --engine batching]",
    "tests/cli/test_serve_defaults.py::test_every_mistake_is_short_exits_2_and_loads_no_model[--config nope.yaml]",
    "tests/cli/test_serve_defaults.py::test_every_mistake_is_short_exits_2_and_loads_no_model[--engine fast]",
    "tests/cli/test_serve_defaults.py::test_every_mistake_is_short_exits_2_and_loads_no_model[--engine sequential --kv-cache-dtype fp8]",
    "tests/cli/test_serve_defaults.py::test_every_mistake_is_short_exits_2_and_loads_no_model[--engine sequential --kv-memory-fraction 0.5]",
    "tests/cli/test_serve_defaults.py::test_every_mistake_is_short_exits_2_and_loads_no_model[--host no-such-host.invalid]",
    "tests/cli/test_serve_defaults.py::test_every_mistake_is_short_exits_2_and_loads_no_model[--port 70000]",
    "tests/cli/test_serve_defaults.py::test_every_mistake_is_short_exits_2_and_loads_no_model[--port TAKEN]",
    "tests/integration/test_api_fuzz.py::test_every_config_is_accepted_whole_or_refused_naming_a_field",
    "tests/integration/test_api_fuzz.py::test_generate_gives_a_clear_error_or_the_reference_tokens",
    "tests/integration/test_causal_prefill.py::test_graph_keys_depend_on_the_bucket_and_the_keys_before_alone[0]",
    "tests/integration/test_causal_prefill.py::test_warm_up_meets_every_graph_key_a_real_chunk_meets",
    "tests/integration/test_compat.py::test_compiled_call_gate_passes_other_calls_through_untouched",
    "tests/integration/test_compiled_decode.py::test_batch_padding_only_where_decode_compiles_and_never_for_other_caches",
    "tests/integration/test_hybrid_compiled_decode.py::test_compiled_decode_with_a_pool_equals_eager_without_recompiles",
    "tests/integration/test_hybrid_compiled_decode.py::test_inductor_decode_equals_eager_and_a_new_prompt_length_does_not_recompile[gemma2]",
    "tests/integration/test_hybrid_compiled_decode.py::test_inductor_decode_equals_eager_and_a_new_prompt_length_does_not_recompile[gemma3]",
    "tests/integration/test_hybrid_compiled_decode.py::test_next_turn_after_compiled_decode_equals_eager",
    "tests/integration/test_hybrid_compiled_decode.py::test_traced_decode_is_one_graph_for_every_prompt_length[cohere2]",
    "tests/integration/test_hybrid_compiled_decode.py::test_triton_backend_decode_step_with_sinks_or_softcap_traces_as_one_graph[gemma2]",
    "tests/integration/test_hybrid_decode_graphs.py::test_a_replayed_hybrid_step_reads_nothing_back_from_the_device[gemma3]",
    "tests/integration/test_hybrid_models.py::test_triton_backend_gives_the_oracles_and_the_twins_tokens[gemma2]",
    "tests/integration/test_hybrid_pool.py::test_graphed_decode_on_the_pool_equals_eager_and_reads_nothing_back[gemma3]",
    "tests/integration/test_import_hook.py::test_a_model_loads_with_rocketkv_attention_after_a_plain_import",
    "tests/integration/test_import_hook.py::test_registered_whatever_the_import_order[import hf_rocketkv]",
    "tests/integration/test_import_hook.py::test_registered_whatever_the_import_order[import transformers.modeling_utils; import hf_rocketkv]",
    "tests/integration/test_norm.py::test_generate_with_a_large_norm_epsilon_keeps_the_models_logits",
    "tests/integration/test_norm.py::test_prefill_and_decode_steps_take_the_fused_norm[llama]",
    "tests/integration/test_norm.py::test_prefill_and_decode_steps_take_the_fused_norm[mistral]",
    "tests/integration/test_norm.py::test_prefill_and_decode_steps_take_the_fused_norm[qwen2]",
    "tests/integration/test_norm.py::test_prefill_and_decode_steps_take_the_fused_norm[qwen3]",
    "tests/integration/test_rope.py::test_calls_that_are_not_rocketkvs_keep_transformers_rope",
    "tests/integration/test_rope.py::test_prefill_and_decode_steps_take_the_fused_rope_bit_for_bit[llama]",
    "tests/kernels/test_e2e_triton.py::test_greedy_tokens_match_torch_backend[12-float32-group_sign]",
    "tests/kernels/test_e2e_triton.py::test_greedy_tokens_match_torch_backend[12-float32-head_bound]",
    "tests/kernels/test_e2e_triton.py::test_greedy_tokens_match_torch_backend[16-float8_e5m2-group_sign]",
    "tests/kernels/test_fused_decode.py::test_fused_decode_equals_twin_and_float64_attention[4-2-4-128-4-1-128-6-2-1-dtype4-kt_dtype4-False-True-3-default]",
    "tests/kernels/test_fused_decode.py::test_fused_decode_equals_twin_and_float64_attention[4-2-4-128-4-1-128-6-2-1-dtype4-kt_dtype4-False-True-3-separate-scoring]",
    "tests/kernels/test_fused_decode.py::test_ties_go_to_the_lower_page_id_as_in_the_selection_rule",
    "tests/kernels/test_select_pages_ties.py::test_select_pages_ties_follow_the_rule[150-16-2-3-16-16-equal]",
    "tests/kernels/test_select_pages_ties.py::test_select_pages_ties_follow_the_rule[150-16-2-3-16-16-tied_blocks]",
    "tests/kernels/test_select_pages_ties.py::test_select_pages_ties_follow_the_rule[150-16-2-3-16-16-two_levels]",
    "tests/kernels/test_select_pages_ties.py::test_select_pages_ties_follow_the_rule[150-16-2-3-16-16-zeros_nan]",
    "tests/memory/test_fresh_process.py::test_hashes_and_prefix_files_agree_across_processes",
    "tests/memory/test_planner.py::test_refusals_say_what_was_asked_and_reservations_count_for_their_owner",
    "tests/memory/test_pool_sizing.py::test_pool_on_cuda_takes_0_9_of_the_free_device_memory",
    "tests/serving/test_fuzz.py::test_fuzz_every_route[POST /detokenize negative]",
    "tests/serving/test_fuzz.py::test_fuzz_every_route[POST /detokenize positive]",
    "tests/serving/test_fuzz.py::test_fuzz_every_route[POST /tokenize positive]",
    "tests/serving/test_fuzz.py::test_fuzz_every_route[POST /v1/chat/completions positive]",
    "tests/serving/test_fuzz.py::test_fuzz_every_route[POST /v1/completions negative]",
    "tests/serving/test_fuzz.py::test_fuzz_every_route[POST /v1/completions positive]",
    "tests/serving/test_hybrid_batching.py::test_a_replayed_batched_step_reads_nothing_back_from_the_device[gemma3]",
    "tests/serving/test_soak.py::test_soak_hostile_clients[llama]",
)
