"""The decode runners of integration/decode_graphs.py on a CPU: a compile config that takes generate()'s
compiled-decode path there, and a stand-in for the CUDA graph backend.

The stand-in keeps what matters of a CUDA graph: capture records the call without running it, replay re-runs it on
the SAME static input buffers with the cache's host bookkeeping switched off (at a real replay no Python runs). So a
runner that forgot to copy an input, to count a step on the host or to reset a graph between turns gives other tokens
or another cache state than the eager run.
"""

from __future__ import annotations

import torch
import torch._dynamo
import torch._dynamo.utils as dynamo_utils
from transformers import CompileConfig

from hf_rocketkv import RocketKVCache
from hf_rocketkv.integration.call_state import call_state


class StandInGraph:
    """A captured step: the call to re-run and its static output."""

    def __init__(self, run):
        self.run = run
        self.output = None


class StandInBackend:
    """Capture = remember; replay = run on the static buffers and write the result into the static output."""

    def __init__(self):
        self.captures = 0
        self.replays = 0

    def warm_up(self, run):
        return run()

    def capture(self, run):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        self.captures += 1
        graph = StandInGraph(run)
        graph.output = CausalLMOutputWithPast()
        return graph, graph.output

    def replay(self, graph):
        self.replays += 1
        out = graph.run()
        for key, value in out.items():
            graph.output[key] = value


def eager_compile_config() -> CompileConfig:
    """generate()'s compiled-decode path on CPU, traced by dynamo (fullgraph) without inductor: fast, and every new
    graph is counted in dynamo's counters."""
    config = CompileConfig(fullgraph=True, mode="default", dynamic=False, backend="eager")
    config._compile_all_devices = True  # take generate()'s compiled-decode path on CPU
    return config


def graphed_cache(config, backend):
    """A RocketKVCache whose decode steps go through CUDA-graph capture on the CPU, with ``backend`` capturing."""
    cache = RocketKVCache(config)
    call_state(cache).use_graphs_on(("cpu",), backend)
    return cache


def unique_graphs() -> int:
    """Graphs dynamo compiled since its counters were last cleared (``dynamo_utils.counters.clear()``)."""
    return dynamo_utils.counters["stats"]["unique_graphs"]


def skip_launches_on_fake_tensors(monkeypatch) -> None:
    """Trace backend="triton" decode steps on CPU: Triton's interpreter cannot run on fake tensors, so while dynamo
    propagates them the kernel launches are skipped (the ops' outputs are allocated by their launchers); the compiled
    graph (backend "eager") then calls the registered ops on real tensors, which run the kernels in the interpreter.
    Resets dynamo, so the next compile traces afresh."""
    from torch._subclasses.fake_tensor import is_fake

    from hf_rocketkv.kernels import launch

    original = launch.TritonLaunch.__getitem__

    def launcher(self, grid):
        run = original(self, grid)

        def call(*args, **kwargs):
            if any(isinstance(x, torch.Tensor) and is_fake(x) for x in (*args, *kwargs.values())):
                return None
            return run(*args, **kwargs)

        return call

    monkeypatch.setattr(launch.TritonLaunch, "__getitem__", launcher)
    torch._dynamo.reset()
