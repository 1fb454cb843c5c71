"""RocketKVCache: transformers ``Cache`` container of RocketKVLayer objects, created lazily per layer.

    cache = RocketKVCache(RocketKVConfig(prompt_budget=256, topk=16))
    model.generate(ids, past_key_values=cache, max_new_tokens=64)
    cache.kept_tokens(0)      # LongTensor [batch, kv_heads] physically stored in layer 0
    cache.get_seq_length()    # logical tokens seen (prompt + fed-back generated tokens)
    cache.memory_bytes()      # K/V + KT + index tensors actually allocated
"""

from __future__ import annotations

import functools

import torch
from transformers import Cache

from .. import compat
from ..config import RocketKVConfig
from .layer import CROP_UNSUPPORTED, INTERRUPTED_FORWARD, UNCONSUMED_KEYS, GenerationHints, RocketKVLayer


class RocketKVCache(Cache):
    """KV cache that evicts after prefill (stage 1) and serves sparse page attention during decode (stage 2).

    Needs a model whose attention implementation is ``"rocketkv"`` (``hf_rocketkv.enable(model)`` or
    ``from_pretrained(..., attn_implementation="rocketkv")``). One cache serves one request: pass a fresh one to
    each ``generate`` call, or continue the same conversation with it.
    """

    def __init__(self, config: RocketKVConfig | None = None, **overrides):
        compat.require()  # a transformers whose private symbols changed fails here, naming version and symbol
        config = config if config is not None else RocketKVConfig()
        if not isinstance(config, RocketKVConfig):
            raise TypeError(f"RocketKVCache(config=...) takes a RocketKVConfig, got {type(config).__name__}")
        self.config = config.replace(**overrides) if overrides else config
        self.hints = GenerationHints()
        self.token_ids: torch.Tensor | None = None  # ids this cache has served (set by generate), guards reuse
        super().__init__(layer_class_to_replicate=functools.partial(RocketKVLayer, self.config, self.hints))

    def empty_like(self) -> "RocketKVCache":
        """A new, empty cache of the same kind and configuration (the stage-1 policy included): row-group prefill
        builds one per group."""
        return type(self)(self.config)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Store ``layer_idx``'s new keys and values (see ``RocketKVLayer.update``).

        Also checks that earlier keys were consumed by a ``rocketkv`` attention call: the previous layer's in this
        forward (so a RocketKVCache on a model whose attention is not ``rocketkv`` fails at the second layer instead
        of silently running dense attention) and this layer's own from the previous forward (the last layer, one-layer
        models, and a forward that an exception interrupted between a layer's update and its attention).
        """
        if not (torch.compiler.is_compiling() or self.hints.in_graph):
            self._check_consistent(layer_idx, key_states.shape[2])
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _check_consistent(self, layer_idx: int, query_length: int) -> None:
        """Raise if an earlier forward left this cache half-updated, or its keys were never consumed.

        Each layer counts on the host the tokens it stored (eager updates; compiled steps skip every layer alike),
        so at layer 0 all layers agree, and at layer i > 0 layer i is exactly this forward's tokens behind layer 0.
        """
        for index in (layer_idx - 1, layer_idx):
            if 0 <= index < len(self.layers) and self.layers[index].awaiting_attention:
                raise RuntimeError(UNCONSUMED_KEYS)
        if not self.layers:
            return
        reference = self.layers[0].host_seen
        if layer_idx == 0:
            counts = [layer.host_seen for layer in self.layers]
            if len(set(counts)) > 1:
                raise RuntimeError(INTERRUPTED_FORWARD.format(detail=f"per layer: {counts}"))
            return
        seen = self.layers[layer_idx].host_seen if layer_idx < len(self.layers) else 0
        if seen + query_length != reference:
            raise RuntimeError(
                INTERRUPTED_FORWARD.format(detail=f"layer {layer_idx}: {seen}, layer 0: {reference - query_length}")
            )

    def preload_prefix(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store the dense keys and values of a prompt prefix computed elsewhere, one ``(K, V)`` pair
        ``[B, Hkv, L, D]`` per layer, in layer order. The rest of the prompt then runs through the model with this
        cache, and stage 1 runs over the whole prompt at the end of that forward, exactly as after a one-shot
        prefill (the eval prefills a shared prefix once for several methods this way). Only on an empty cache."""
        if self.get_seq_length() != 0:
            raise ValueError("preload_prefix needs an empty RocketKVCache")
        for layer_idx, (keys, values) in enumerate(kv):
            super().update(keys, values, layer_idx)
            self.layers[layer_idx].attention_ran()  # stored on purpose: no attention call consumes these

    def seq_length_tensor(self, layer_idx: int = 0) -> torch.Tensor:
        """Logical tokens seen, as a 0-d int64 tensor on the cache's device (no host sync).

        For hand-written decode loops: ``position_ids = cache.seq_length_tensor() + torch.arange(n)`` instead of
        ``cache.get_seq_length()``, which returns a Python int and therefore waits for the GPU at every step.
        """
        if layer_idx >= len(self.layers) or not self.layers[layer_idx].is_initialized:
            return torch.zeros((), dtype=torch.long)
        return self.layers[layer_idx].seen

    def get_query_offset(self, layer_idx: int = 0):
        """Logical position of the next query, for transformers' mask code (called before every forward).

        Compressed layers ignore that mask, so they answer with the device counter itself (as StaticLayer does):
        ``get_seq_length()`` would turn it into a Python int, a host sync at every decode step.
        """
        if layer_idx < len(self.layers) and self.layers[layer_idx].compressed:
            return self.layers[layer_idx].seen
        return super().get_query_offset(layer_idx)

    def finish_prefill(self) -> None:
        """Run stage 1 on every layer still holding a full prompt.

        Only needed after chunked prefill (``hints.defer_compression``): generate() calls it once the last chunk is
        in; call it yourself when you feed a prompt in chunks through plain forwards with deferred compression.
        """
        for layer in self.layers:
            layer.finish_prefill()

    def adopt_row_groups(self, parts: list["RocketKVCache"]) -> None:
        """Take over the compressed layers of caches that each prefilled some rows, in row order (row-group
        prefill, ``RocketKVConfig.prefill_batch_size``). This cache must be empty."""
        if self.get_seq_length() != 0:
            raise ValueError("adopt_row_groups needs an empty RocketKVCache")
        self.layers = [
            RocketKVLayer.stack_rows([part.layers[i] for part in parts], self.layer_class_to_replicate)
            for i in range(len(parts[0].layers))
        ]

    # ------------------------------------------------------------------------------------------ introspection
    def kept_tokens(self, layer_idx: int) -> torch.LongTensor:
        """Tokens physically stored per row and KV head in ``layer_idx``: LongTensor ``[batch, kv_heads]``."""
        if layer_idx >= len(self.layers):
            raise IndexError(f"layer {layer_idx} has no state yet ({len(self.layers)} layers initialised)")
        return self.layers[layer_idx].kept_tokens()

    def memory_bytes(self) -> int:
        """Bytes of every tensor the cache holds: K/V, KT page summaries, positions and lengths."""
        return sum(layer.memory_bytes() for layer in self.layers)

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """Input column of every stored token, ``[batch, kv_heads, capacity]`` int32, -1 for empty slots."""
        layer = self.layers[layer_idx]
        if not layer.compressed:
            raise ValueError(f"layer {layer_idx} is not compressed yet (stage 1 runs at the end of prefill)")
        return layer.positions

    @property
    def is_compileable(self) -> bool:
        """generate() compiles decode steps for compileable caches (on CUDA, or with compile_config's
        ``_compile_all_devices``). It asks once before prefill (for decode) and again inside a chunked prefill (for
        the chunks): the answer is False only while generate()'s prefill runs, so chunks run eagerly (their shapes
        change every chunk) and decode is compiled after a chunked prefill too."""
        return not self.hints.prefilling

    @property
    def is_compressed(self) -> bool:
        return len(self.layers) > 0 and all(layer.compressed for layer in self.layers)

    def crop(self, tokens_to_remove: int) -> None:
        """Undo the last ``-tokens_to_remove`` decode steps (see ``RocketKVLayer.crop``); anything else raises."""
        if tokens_to_remove > 0:
            raise NotImplementedError(CROP_UNSUPPORTED)
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def __repr__(self) -> str:
        return f"RocketKVCache(layers={len(self.layers)}, seen={self.get_seq_length()}, config={self.config})"
