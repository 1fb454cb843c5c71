"""One fresh Python process (another PYTHONHASHSEED) checks what must not depend on the process: prefix hashes, and a
prefix file loading bit-exact. It imports memory/ under a stub parent package, which also shows that the floor runs
without transformers (and keeps the subprocess fast)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from hf_rocketkv.memory import PrefixKeys
from hf_rocketkv.memory.hashing import MultimodalItem, page_hashes, root_hash
from tests.memory.helpers import fill_pages, make_pool, page_bytes_of, rocket_config

REPO = Path(__file__).resolve().parents[2]
IDS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3] * 3  # 48 tokens: 6 pages of 8
KEYS = "PrefixKeys(cache_salt='salt', adapter='lora', multimodal=(MultimodalItem('img', 5, 6),))"

CHILD = """
import hashlib, json, sys, types
root = {repo!r}
sys.path.insert(0, root)
stub = types.ModuleType("hf_rocketkv")  # the package without its __init__ (which imports transformers)
stub.__path__ = [root + "/hf_rocketkv"]
sys.modules["hf_rocketkv"] = stub
from hf_rocketkv.memory import PrefixKeys
from hf_rocketkv.memory.hashing import MultimodalItem, page_hashes, root_hash
from tests.memory.helpers import make_pool, page_bytes_of
hashes = [h.hex() for h in page_hashes(root_hash("x" * 64), {ids}, 4, {keys})]
pool = make_pool(24)
pool.load_prefix({path!r})
pages = [hashlib.sha256(page_bytes_of(pool, i.index)).hexdigest() for i in pool.resident_prefix({ids})]
print(json.dumps({{"hashes": hashes, "pages": pages, "transformers": "transformers" in sys.modules}}))
"""


def test_hashes_and_prefix_files_agree_across_processes(tmp_path):
    keys = PrefixKeys(cache_salt="salt", adapter="lora", multimodal=(MultimodalItem("img", 5, 6),))
    here = [h.hex() for h in page_hashes(root_hash("x" * 64), IDS, 4, keys)]
    pool = make_pool(24)
    adm = pool.admit(len(IDS), 0, rocket_config(), token_ids=IDS)
    fill_pages(pool, adm.prompt.pages, seed=9)
    pool.commit_prompt(adm)
    pages = [hashlib.sha256(page_bytes_of(pool, p)).hexdigest() for p in adm.prompt.pages]
    pool.release(adm)
    path = tmp_path / "p.safetensors"
    pool.save_prefix(path, IDS)
    script = CHILD.format(repo=str(REPO), ids=IDS, keys=KEYS, path=str(path))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # a different Python hash() seed must not matter
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child["hashes"] == here
    assert child["pages"] == pages and len(pages) == 6
    assert child["transformers"] is False
