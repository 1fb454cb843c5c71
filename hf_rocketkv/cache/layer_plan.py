"""What each layer of a RocketKVCache is, from the config's per-layer fields (``dense_layers``, ``budget_schedule``).

    layer index < dense_layers    a ``DenseLayer``: every token kept and attended, nothing scored, evicted or paged
    every other layer             a RocketKV layer with the config's budgets (``"flat"``), or its share of them
                                  (``"pyramid"``)

Pyramid (PyramidKV-style): the n RocketKV layers after the dense ones get weights ``w_j = 1.5 - j / (n - 1)``
(``j = 0 .. n-1``; 1.5x at the first, 0.5x at the last, mean 1), and layer j keeps ``round(w_j * prompt_budget)``
prompt tokens and reads ``round(w_j * topk)`` pages, rounded by largest remainder so that the n layers together keep
``n * prompt_budget`` tokens and read ``n * topk`` pages, exactly the flat totals. A share below the layer's minimum
(``window_size`` for prompt_budget, the forced stage-2 pages for topk) is raised to it (the total then grows by that).
Sliding-window layers of a hybrid model stay sliding (their window is already what they keep); they count among the
n layers of the schedule like any other layer after the dense ones.
"""

from __future__ import annotations

from ..config import RocketKVConfig, forced_page_counts

PYRAMID_TOP, PYRAMID_BOTTOM = 1.5, 0.5


def schedule_weights(schedule: str, count: int) -> list[float]:
    """The weight of each of ``count`` RocketKV layers (mean 1)."""
    if schedule == "flat" or count == 1:
        return [1.0] * count
    if schedule == "pyramid":
        step = (PYRAMID_TOP - PYRAMID_BOTTOM) / (count - 1)
        return [PYRAMID_TOP - j * step for j in range(count)]
    raise ValueError(f"RocketKVConfig.budget_schedule must be 'flat' or 'pyramid', got {schedule!r}")


def shares(per_layer: int, schedule: str, count: int, minimum: int) -> list[int]:
    """``per_layer * w_j`` rounded by largest remainder (summing to ``per_layer * count``), each at least
    ``minimum``."""
    exact = [per_layer * w for w in schedule_weights(schedule, count)]
    values = [int(x) for x in exact]
    left = per_layer * count - sum(values)
    by_remainder = sorted(range(count), key=lambda j: (-(exact[j] - values[j]), j))
    for j in by_remainder[:left]:
        values[j] += 1
    return [max(v, minimum) for v in values]


def check_layer_count(config: RocketKVConfig, num_layers: int) -> None:
    """Refuse ``dense_layers`` that leave the model no RocketKV layer."""
    if config.dense_layers >= num_layers:
        raise ValueError(f"RocketKVConfig.dense_layers={config.dense_layers} must be below the model's "
                         f"{num_layers} layers (at least one RocketKV layer); use 0 .. {num_layers - 1}")


def needs_layer_count(config: RocketKVConfig) -> bool:
    """A schedule other than flat spreads the budgets over the model's layers: the cache must know how many."""
    return config.budget_schedule != "flat"


def layer_config(config: RocketKVConfig, layer_idx: int, num_layers: int | None) -> RocketKVConfig | None:
    """The config of RocketKV layer ``layer_idx`` (its scheduled budgets), or None for a dense layer."""
    if layer_idx < config.dense_layers:
        return None
    if not needs_layer_count(config):
        return config
    if num_layers is None:
        raise ValueError(f"RocketKVConfig.budget_schedule={config.budget_schedule!r} spreads the budgets over the "
                         f"model's layers, so the cache needs their count: RocketKVCache(config, "
                         f"model_config=model.config) (generate() passes it itself)")
    check_layer_count(config, num_layers)
    if layer_idx >= num_layers:
        raise ValueError(f"RocketKVCache: the model config has {num_layers} layers, the model updates layer "
                         f"{layer_idx}")
    count, j = num_layers - config.dense_layers, layer_idx - config.dense_layers
    sink, recent = forced_page_counts(config.stage2_sink_tokens, config.stage2_recent_tokens, config.page_size)
    budget = shares(config.prompt_budget, config.budget_schedule, count, config.window_size)[j]
    topk = shares(config.topk, config.budget_schedule, count, max(sink + recent, 1))[j]
    return config.replace(prompt_budget=budget, topk=topk)


def layer_budgets(config: RocketKVConfig, num_layers: int) -> list[tuple[int, int] | None]:
    """``(prompt_budget, topk)`` of every layer, None for dense layers (docs and the fidelity study's read counts)."""
    check_layer_count(config, num_layers)
    out = []
    for i in range(num_layers):
        layer = layer_config(config, i, num_layers)
        out.append(None if layer is None else (layer.prompt_budget, layer.topk))
    return out
