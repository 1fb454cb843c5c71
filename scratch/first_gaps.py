import sys, torch, statistics
sys.path.insert(0, '.')
from hf_rocketkv import RocketKVCache
from hf_rocketkv.bench.decode import LLAMA_31_8B, build_model, StepClock
from hf_rocketkv.config import RocketKVConfig
from hf_rocketkv.integration.registration import enable
from transformers import LogitsProcessorList
model = build_model(LLAMA_31_8B, None, torch.bfloat16, torch.device('cuda'), 0)
enable(model)
graphs = sys.argv[1] == "on"
ids = torch.randint(3, 1000, (1, 8192), device='cuda')
for n in range(2):
    cache = RocketKVCache(RocketKVConfig(backend='triton', eager_layer_graphs=graphs))
    clock = StepClock(ids.device); clock.start()
    model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=96, min_new_tokens=96,
                   do_sample=False, eos_token_id=None, disable_compile=True, logits_processor=LogitsProcessorList([clock]))
    t = clock.seconds(); gaps = [round((b-a)*1e3,1) for a,b in zip(t,t[1:])]
    print(sys.argv[1], n, "median", statistics.median(gaps[3:]), gaps, flush=True)
