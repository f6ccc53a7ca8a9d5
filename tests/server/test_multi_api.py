"""`fulcrum serve --api-server-count 2`: two HTTP processes in front of one engine core."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import openai
from srv_helpers import MODEL, make_adapter, start_server, wait_idle


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def test_two_api_processes_share_one_core(tmp_path) -> None:
    s = start_server(str(tmp_path), "--api-server-count", "2", "--max-model-len", "512",
                     "--max-num-seqs", "8", "--kv-cache-memory", "0.25",
                     "--allow-runtime-lora-updates")  # fmt: skip
    try:
        kids = _children(s.proc.pid)
        assert len(kids) >= 3  # the engine core and two API processes
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        msg = [{"role": "user", "content": "Name three colors."}]
        kw = dict(model=MODEL, messages=msg, max_tokens=6, temperature=0)

        def ask(i: int) -> str:
            if i % 2:
                chunks = client.chat.completions.create(stream=True, **kw)
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return client.chat.completions.create(**kw).choices[0].message.content

        with ThreadPoolExecutor(6) as pool:  # new connections: the kernel spreads them
            texts = list(pool.map(ask, range(6)))
        assert len(set(texts)) == 1 and texts[0]  # greedy: the same answer from either process
        m = wait_idle(s)
        # Counters are summed over both processes; the one core's prefix cache served repeats.
        assert m["fulcrum:request_success_total"] == 6
        assert m["fulcrum:generation_tokens_total"] == 36
        assert m["fulcrum:prefix_cache_hits_total"] > 0
        with open(s.log_file) as f:
            assert len(f.read().splitlines()) == 6  # both processes append to the one log
        # n > 1: each of a request's sequences goes back to the process that sent it (the
        # first one to finish must not hand the others to another process, where they hang)
        quick = client.with_options(timeout=30)
        multi = dict(kw, n=3, max_tokens=4, temperature=0.8)
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda _: quick.chat.completions.create(**multi), range(8)))
        assert all(sorted(c.index for c in o.choices) == [0, 1, 2] for o in outs)
        # an adapter loaded through one process is served by both (the core tells each)
        path = make_adapter(str(tmp_path / "adapter"))
        status, _, _ = s.request("POST", "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": path})
        assert status == 200
        lora = dict(kw, model="a")
        with ThreadPoolExecutor(6) as pool:
            listed = list(pool.map(lambda _: [m.id for m in client.models.list().data], range(6)))
            answers = list(pool.map(lambda _: client.chat.completions.create(**lora), range(6)))
        assert all("a" in ids for ids in listed)
        assert len({a.choices[0].message.content for a in answers}) == 1
        assert answers[0].choices[0].message.content != texts[0]
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0
        deadline = time.monotonic() + 10  # multiprocessing's resource tracker ends on its own
        while any(os.path.exists(f"/proc/{k}") for k in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [k for k in kids if os.path.exists(f"/proc/{k}")]  # no orphans
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
