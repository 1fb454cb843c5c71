"""The short report ``hf-rocketkv generate`` prints after the answers: what was kept, the bytes, the speed."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .runs import TimedRun


def human_bytes(n: float) -> str:
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


def over_full_note(rocket_bytes: int, full_bytes: int, prompt_tokens: int, config) -> str:
    """Why a RocketKV cache can hold more bytes than the full cache: a prompt within ``prompt_budget`` keeps every
    token, and the KT summaries and preallocated decode slots come on top."""
    if rocket_bytes <= full_bytes:
        return ""
    if prompt_tokens <= config.prompt_budget:
        return (f" (the prompt fits prompt_budget={config.prompt_budget}: nothing was evicted, and the KT page "
                f"summaries and preallocated decode slots come on top; compression starts above the budget)")
    return " (the KT page summaries and preallocated decode slots come on top of the kept tokens)"


def full_cache_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int, element_size: int) -> int:
    """Bytes of a full (DynamicCache) K/V store holding ``tokens`` tokens: K and V, every layer and KV head."""
    return 2 * layers * kv_heads * head_dim * tokens * element_size


def speed(run: TimedRun | None) -> str:
    if run is None:
        return "-"
    per_token = run.ms_per_token
    decode = f"{per_token:.1f} ms/token over {run.decode_steps} steps" if per_token is not None else "one token only"
    return f"{decode}, prefill {run.prefill_s:.2f} s"


def answers_line(rocket: TimedRun, full: TimedRun | None, tokenizer) -> str:
    if full is None:
        return "answer vs the full cache: not compared (--no-compare)"
    if rocket.new_ids == full.new_ids:
        return f"answer vs the full cache: identical ({len(rocket.new_ids)} tokens)"
    same = next((i for i, (a, b) in enumerate(zip(rocket.new_ids, full.new_ids)) if a != b), None)
    where = f"from token {same}" if same is not None else "in length"
    text = tokenizer.decode(full.new_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False).strip()
    return f"answer vs the full cache: differs {where}; full cache answered {text!r}"


def generate_report(
    *,
    model,
    model_name: str,
    config,
    cache,
    tokenizer,
    prompt_tokens: int,
    rocket: TimedRun,
    full: TimedRun | None,
    threads: str,
) -> str:
    """Report lines; ``cache`` is the RocketKVCache after ``rocket`` ran, ``full`` the full cache's run or None."""
    layers = cache.layers
    stored = [round(float(cache.kept_tokens(i).float().mean())) for i in range(len(layers))]
    seen = cache.get_seq_length()
    keys = layers[0].keys
    kv_heads, head_dim, elem = keys.shape[1], keys.shape[3], keys.element_size()
    full_bytes = full_cache_bytes(len(layers), kv_heads, head_dim, seen, elem)
    rocket_bytes = cache.memory_bytes()
    generated = len(rocket.new_ids)
    kept_prompt = sum(stored) / len(stored) - (seen - prompt_tokens)
    cfg = config
    lines = [
        "",
        "--- hf-rocketkv report ---",
        f"model: {model_name} ({type(model).__name__}, {len(layers)} layers, {kv_heads} KV heads x {head_dim}, "
        f"{keys.dtype}, {keys.device}, {threads})",
        f"config: prompt_budget={cfg.prompt_budget} topk={cfg.topk} page_size={cfg.page_size} topr={cfg.topr} "
        f"window_size={cfg.window_size} kernel_size={cfg.kernel_size} kt_cache_dtype={cfg.kt_cache_dtype} "
        f"backend={cfg.backend}",
        f"prompt tokens: {prompt_tokens}   kept per layer and KV head: {kept_prompt:.0f} "
        f"({100 * kept_prompt / prompt_tokens:.1f}%)   new tokens: {generated}   tokens seen by the cache: {seen}",
        f"stored tokens per layer and KV head (kept prompt + generated): min {min(stored)} / "
        f"mean {sum(stored) / len(stored):.1f} / max {max(stored)}; per layer: {compact_list(stored)}",
        f"read per decode step: at most {cfg.topk} pages x {cfg.page_size} = {cfg.topk * cfg.page_size} tokens "
        f"per KV head (+ KT page summaries)",
        f"KV cache: {human_bytes(rocket_bytes)} (RocketKVCache.memory_bytes(): KT and preallocated slots included) "
        f"vs {human_bytes(full_bytes)} for the full cache (2*{len(layers)}*{kv_heads}*{head_dim}*{seen}*{elem} B) "
        f"= {100 * rocket_bytes / full_bytes:.1f}%" + over_full_note(rocket_bytes, full_bytes, prompt_tokens, cfg),
        f"RocketKV:   {speed(rocket)}",
        f"full cache: {speed(full)}" + ("" if full is not None else " (not run: --no-compare)"),
        answers_line(rocket, full, tokenizer),
    ]
    return "\n".join(lines)
